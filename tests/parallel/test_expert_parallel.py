"""MoE experts split over 2 gloo ranks by EPLB placements (with hot replicas): a V4 MoE layer's
output, and a whole tiny V4 model's logits, equal the single-device ones on every rank."""

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.layers.moe import dispatch_experts
from deepinfer.models.deepseek_v4 import V4MoE
from deepinfer.parallel.eplb import balanced_placement, contiguous_placement
from deepinfer.parallel.expert_parallel import ExpertShard, shard_experts

WORLD = 2
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny V4 of the model tests


def moe_layer():
    from test_deepseek_v4 import tiny_v4_config

    torch.manual_seed(0)
    cfg = tiny_v4_config(n_routed_experts=8, num_experts_per_tok=3)
    block = V4MoE(cfg, 1)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(40, cfg.hidden_size)
    idx, w = block.route(x, torch.zeros(40, dtype=torch.long))
    return block, x, idx, w


def worker(rank, port, placements):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        block, x, idx, w = moe_layer()
        ref, _ = dispatch_experts(x, idx, w, block.num_experts, block.experts)
        for placement in placements:
            shard = ExpertShard(block.experts, placement, rank)
            assert shard.experts.gate_up_proj.shape[0] == len(set(placement.devices[rank]))
            with torch.no_grad():
                out = shard(x, idx, w)
            # the same products, summed in another order (outputs up to ~30)
            torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_expert_parallel_equals_single_device():
    _, _, idx, _ = moe_layer()
    loads = torch.bincount(idx.flatten(), minlength=8).tolist()
    placements = [contiguous_placement(8, WORLD), balanced_placement(loads, WORLD, extra=1)]
    assert max(placements[1].copies) > 1  # some expert is served by two ranks
    # fork: the children inherit the imported modules (spawning re-imports torch and transformers)
    mp.start_processes(worker, args=(free_port(), placements), nprocs=WORLD, join=True,
                       start_method="fork")


def model_worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from model_check import make_runner, random_ids, run_prompt_logits
        from test_deepseek_v4 import tiny_v4

        model = tiny_v4(n_routed_experts=8, num_experts_per_tok=3)
        ids = random_ids(37, 256, 3)
        runner = make_runner(model)
        ref = run_prompt_logits(runner, ids)
        stats = runner.model.moe_stats()
        placements = {layer: balanced_placement([float(c) for c in s["total"]], WORLD, extra=1)
                      for layer, s in stats["layers"].items()}
        shard_experts(runner.model, placements, rank)
        for layer in runner.model.model.layers:  # this rank holds only its slots' experts
            assert layer.mlp.experts.gate_up_proj.shape[0] == len(set(placements[layer.mlp.layer_idx].devices[rank]))
        got = run_prompt_logits(runner, ids, rid="again")
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        assert runner.model.moe_stats()["layers"][1]["total"] == [2 * c for c in stats["layers"][1]["total"]]
    finally:
        dist.destroy_process_group()


def test_sharded_model_logits_equal_single_device():
    mp.start_processes(model_worker, args=(free_port(),), nprocs=WORLD, join=True, start_method="fork")
