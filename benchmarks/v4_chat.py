"""Tiny DeepSeek-V4 / V4.1 multi-turn chat: prefix hits vs the ideal, replayed tokens per hit, and
EPLB expert-placement imbalance on the MoE loads the same run recorded.

The models are random (no hub access) but have the shape where it matters for caching: a
128-token window on every layer; V4: CSA (r=4, Lightning Indexer) and HCA (r=128) layers,
hash-routed first layer; V4.1 (CSA2): window-only layers, a ratio-2 group (FULL, REUSE, REINDEX)
and a ratio-1 group (FULL, REUSE) sharing long KV; 32 routed experts. Several conversations
(shared system prompt, turns interleaved) run through the in-process engine once per
``--window-reuse`` mode; the history holds each mode's own replies. Reported per model and mode:
cached / replayed / computed prompt tokens, hit rate against the ideal (everything before the new
user message), replayed tokens per hit; then, per MoE layer of V4, the max/mean device load of a
contiguous expert layout and of EPLB with one hot replica per device, on the tokens each expert
received. Counts only, so a busy machine does not change them.

    python benchmarks/v4_chat.py [--models v4,v41] [--conversations 4] [--turns 6] [--devices 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM as EngineV4
from deepinfer.models.deepseek_v41_config import DeepseekV41Config
from deepinfer.parallel.eplb import placement_report
from deepinfer.sampling_params import SamplingParams

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]


def tiny_v4(path: Path, experts: int) -> Path:
    cfg = DeepseekV4Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=8,
        index_head_dim=16, index_topk=16, sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        layer_types=LAYERS, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2,
        hc_sinkhorn_iters=3, max_position_embeddings=8192, num_nextn_predict_layers=0,
        eos_token_id=1, bos_token_id=0)
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        table = torch.rand(cfg.vocab_size, experts, generator=g).argsort(-1)[:, :2]
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_v41(path: Path, experts: int) -> Path:
    """A random V4.1 (no transformers model exists): our model class's own weights, saved."""
    from safetensors.torch import save_file

    cfg = DeepseekV41Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=8,
        index_head_dim=16, index_topk=16, sliding_window=128, compress_ratios=[0, 2, 2, 2, 1, 1],
        kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4], mlp_layer_types=["moe"] * 6,
        hc_mult=2, hc_sinkhorn_iters=3, max_position_embeddings=8192, num_nextn_predict_layers=0,
        eos_token_id=1, bos_token_id=0)
    cfg.architectures = ["DeepseekV41ForCausalLM"]
    model = EngineV4(cfg, 8192)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif not name.endswith("norm.weight"):
                p.zero_()  # sinks, mHC biases / scales, router selection bias
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


def save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over the ids (the engine loads one; the chat feeds ids directly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(path)


def chat(llm: LLM, conversations: int, turns: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(2, 500, (n,), generator=g).tolist()  # noqa: E731
    system = words(150)
    history = [list(system) for _ in range(conversations)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in range(turns):
        for c in range(conversations):
            ideal = len(history[c]) if turn else (len(system) if c else 0)
            prompt = history[c] + words(40 + 7 * (turn % 3))
            o = llm.generate(prompt, sp)[0]
            rows.append(dict(conversation=c, turn=turn, prompt=o.num_prompt_tokens, ideal=ideal,
                             cached=o.num_cached_tokens, replayed=o.num_replayed_tokens,
                             computed=o.num_computed_tokens))
            history[c] = prompt + o.token_ids
    return rows


def summary(rows: list[dict]) -> dict:
    hits = [r for r in rows if r["cached"] + r["replayed"] > 0]
    total = lambda k: sum(r[k] for r in rows)  # noqa: E731
    return dict(prompt_tokens=total("prompt"), ideal_hit_tokens=total("ideal"), cached=total("cached"),
                replayed=total("replayed"), computed=total("computed"), hits=len(hits),
                hit_rate_vs_ideal=round(total("cached") / max(1, total("ideal")), 4),
                replayed_per_hit=round(total("replayed") / max(1, len(hits)), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="v4,v41")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--modes", default="snapshot,replay,off")
    ap.add_argument("--out", default="results/v4_chat")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    builders = {"v4": tiny_v4, "v41": tiny_v41}
    result: dict = {"cpu": lscpu_model(), "models": {}}
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = builders[name](Path(tmp), args.experts)
            save_tokenizer(path, 512)
            runs: dict = {"modes": {}}
            for mode in args.modes.split(","):
                llm = LLM(str(path), page_size=16, max_num_seqs=4, progress=False, enable_disk_cache=False,
                          host_cache_gb=0, window_reuse=mode)
                llm.engine.runner.model.reset_moe_stats()
                runs["modes"][mode] = summary(chat(llm, args.conversations, args.turns, seed=7))
                print(name, mode, json.dumps(runs["modes"][mode]), flush=True)
                if mode == "snapshot" and name == "v4":
                    stats = llm.engine.runner.model.moe_stats()
                    runs["eplb"] = [dict(layer=r.layer, before=round(r.before, 3), after=round(r.after, 3))
                                    for r in placement_report(stats, args.devices, extra=1)]
                    print(f"EPLB, {args.experts} experts on {args.devices} devices, 1 hot replica each:",
                          json.dumps(runs["eplb"]), flush=True)
            result["models"][name] = runs
    print("cpu:", result["cpu"])
    (out / "summary.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
