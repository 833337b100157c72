"""Command line: ``deepinfer generate | chat`` (and the subcommands other modules add)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import EngineConfig
from .errors import RequestError
from .sampling_params import SamplingParams
from .spec.config import SpeculativeConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from .layers.native_decode import ATTENTION_BACKENDS
    from .quant.kernels import KERNELS, QUANTIZATIONS

    d = EngineConfig()
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, help="auto (bfloat16 on CUDA and on CPUs with native "
                   "bf16 matmul, AMX or AVX512-BF16; else float32) | float32 | float16 | bfloat16")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: the cores this process may run on)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="keep --threads where other processes take cores (default: run on the cores they leave free)")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="weight-only quantization of every linear layer, LM head included")
    p.add_argument("--quantization-kernel", default=d.quantization_kernel, choices=KERNELS,
                   help="auto: the fastest accurate kernel here; native (ours, CPU, int16-rounded activations; "
                        "native-int8: int8-rounded, lossy; native-float: exact); fbgemm (int8, lossy); tinygemm (int4, bf16); dequant")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="decode attention: auto (our CPU kernel, reads KV pages in place) | torch (gather + SDPA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the Python modules (no native decode stack)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--num-pages", type=int, default=None, help="device KV pool size in pages")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--overlap-schedule", action="store_true", help="schedule step N+1 and land "
                   "step N-1 while step N's forward runs on a worker thread (same outputs)")
    add_window_args(p)
    add_tier_args(p)
    add_speculative_args(p)


def add_window_args(p: argparse.ArgumentParser) -> None:
    from .kv.window.manager import REUSE_MODES

    d = EngineConfig()
    w = p.add_argument_group("sliding-window layers (hybrid models such as Gemma 2/3, Mistral, gpt-oss)")
    w.add_argument("--window-reuse", default=d.window_reuse, choices=REUSE_MODES,
                   help="how a prefix hit gets the sliding layers' window back: snapshot (restore "
                        "the nearest boundary snapshot, replay as fallback), replay (recompute), "
                        "off (a hit on a hybrid model is recomputed)")
    w.add_argument("--window-snapshot-gb", type=float, default=d.window_snapshot_gb,
                   help="host memory for window snapshots (LRU)")
    w.add_argument("--window-snapshot-interval", type=int, default=d.window_snapshot_interval,
                   help="tokens between snapshots inside a long prompt (default: the window; 0: "
                        "only at turn ends and prefix junctions)")
    w.add_argument("--window-replay-tokens", type=int, default=d.window_replay_tokens,
                   help="replay at most this many tokens (default: exact replay; fewer is lossy)")
    w.add_argument("--no-window-ring", action="store_true",
                   help="sliding layers keep every token in the paged pool instead of a ring of W")


def add_tier_args(p: argparse.ArgumentParser) -> None:
    from .kv.tiers.codecs import CODEC_NAMES
    from .kv.tiers.policy import POLICIES

    d = EngineConfig()
    t = p.add_argument_group("KV cache tiers (L2 host memory, L3 disk)")
    t.add_argument("--host-cache-gb", type=float, default=d.host_cache_gb,
                   help="L2 host-DRAM KV cache size, at most half the available RAM; 0 turns L2 off")
    t.add_argument("--disk-cache-dir", default=None,
                   help="L3 directory, may be shared by several engines (default: "
                        "$DEEPINFER_KV_CACHE_DIR, $DEEPINFER_CACHE_DIR/kv or ~/.cache/deepinfer/kv)")
    t.add_argument("--disk-cache-gb", type=float, default=d.disk_cache_gb, help="L3 size bound")
    t.add_argument("--no-disk-cache", action="store_true", help="turn L3 off")
    add_secret_arg(t)
    t.add_argument("--kv-codec-host", default=d.kv_codec_host, choices=CODEC_NAMES, help="L2 page codec")
    t.add_argument("--kv-codec-disk", default=d.kv_codec_disk, choices=CODEC_NAMES, help="L3 page codec")
    t.add_argument("--cache-policy", default=d.cache_policy, choices=POLICIES,
                   help="write_through: every cached page also goes to L3 at once; write_back: pages "
                        "go down a tier only when evicted; selective: L3 only after --selective-hits hits")
    t.add_argument("--selective-hits", type=int, default=d.selective_hits)
    t.add_argument("--kv-idle-promote-mb", type=float, default=d.kv_idle_promote_mb,
                   help="server: while idle, promote recent conversations' L3 pages to L2, at "
                        "most this many MiB per idle period (0, the default: off)")
    t.add_argument("--kv-stream-layers", action="store_true",
                   help="L3 hits load layer by layer, their prefill computing layer i as i+1 loads")
    t.add_argument("--kv-store", default=None, metavar="URL",
                   help="networked L3 shared by engines, behind the local directory: "
                        "mooncake://MASTER_HOST:PORT or redis://HOST:PORT[/DB]")
    t.add_argument("--kv-store-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the store (repeatable), e.g. protocol=tcp, "
                        "global_segment_size=1073741824, retry_s=5 (docs/architecture.md)")


def add_secret_arg(p) -> None:
    p.add_argument("--kv-store-secret", default=os.environ.get("DEEPINFER_KV_STORE_SECRET"),
                   help="key of the L3 files' MAC: only files written with it are read, so a shared "
                        "directory cannot be poisoned without it (default: "
                        "$DEEPINFER_KV_STORE_SECRET, else a plain XXH3-128)")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    from .spec.config import METHODS

    d = SpeculativeConfig()
    s = p.add_argument_group("speculative decoding (on: auto, prompt lookup and the shared suffix "
                             "index, scheduled; none turns it off)")
    s.add_argument("--speculative-method", default=d.method, choices=METHODS,
                   help="auto (ngram or suffix, whichever is calibrated better per request; off "
                        "with --overlap-schedule); ngram: prompt lookup in "
                        "the request; suffix: continuations seen in other requests and earlier "
                        "turns; draft_model: --speculative-draft-model; none: off")
    s.add_argument("--speculative-draft-model", default=None, metavar="PATH",
                   help="a small model sharing the target's tokenizer drafts (implies "
                        "--speculative-method draft_model)")
    s.add_argument("--speculative-num-tokens", type=int, default=d.num_tokens,
                   help="k: draft tokens per request per step (fixed-k verifies all of them)")
    s.add_argument("--speculative-scheduled", action=argparse.BooleanOptionalAction, default=d.scheduled,
                   help="verify what Algorithm 1 picks from calibrated confidences and the "
                        "SPS(B) profile measured on the engine (--no-speculative-scheduled: fixed k)")
    s.add_argument("--speculative-ngram-min", type=int, default=d.ngram_min)
    s.add_argument("--speculative-ngram-max", type=int, default=d.ngram_max)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    method = args.speculative_method
    if args.speculative_draft_model and method == "auto":
        method = "draft_model"
    return SpeculativeConfig(method=method, num_tokens=args.speculative_num_tokens,
                             model=args.speculative_draft_model,
                             scheduled=args.speculative_scheduled,
                             ngram_min=args.speculative_ngram_min,
                             ngram_max=args.speculative_ngram_max)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from .kv.tiers.store_clients import parse_store_options

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, threads=args.threads, fixed_threads=args.fixed_threads,
        quantization=args.quantization, quantization_kernel=args.quantization_kernel,
        max_model_len=args.max_model_len,
        page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_cache=not args.no_prefix_cache, overlap_schedule=args.overlap_schedule,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        window_reuse=args.window_reuse, window_snapshot_gb=args.window_snapshot_gb,
        window_snapshot_interval=args.window_snapshot_interval,
        window_replay_tokens=args.window_replay_tokens, window_ring=not args.no_window_ring,
        host_cache_gb=args.host_cache_gb, enable_disk_cache=not args.no_disk_cache,
        disk_cache_dir=args.disk_cache_dir, disk_cache_gb=args.disk_cache_gb,
        kv_codec_host=args.kv_codec_host, kv_codec_disk=args.kv_codec_disk,
        kv_store_secret=args.kv_store_secret or None,
        cache_policy=args.cache_policy, selective_hits=args.selective_hits,
        kv_idle_promote_mb=args.kv_idle_promote_mb, kv_stream_layers=args.kv_stream_layers,
        kv_store=args.kv_store, kv_store_options=parse_store_options(args.kv_store_option),
        speculative_config=speculative_config(args))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    llm = LLM.from_config(engine_config(args))
    params = sampling_params(args)
    prompts = args.prompt or ["The three most useful things to know about caching are"]
    if args.chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out.text}")
        print(f"[{_cache_line(out)}, finish={out.finish_reason}]", file=sys.stderr)
    llm.engine.shutdown()
    return 0


def _cache_line(out) -> str:
    """Where a request's prompt tokens came from, for the per-request summary line."""
    parts = [f"{t} {n}" for t, n in out.cached_tokens_by_tier.items() if n]
    tiers = f" ({', '.join(parts)})" if parts else ""
    replayed = f"{out.num_replayed_tokens} replayed, " if out.num_replayed_tokens else ""
    loaded = ""
    if out.load_seconds:
        by = ", ".join(f"{t} {out.load_bytes_by_tier[t] / 1e6:.1f} MB in {sec:.3f}s"
                       for t, sec in out.load_seconds_by_tier.items() if out.load_bytes_by_tier[t])
        loaded = f"; loaded {by}: {out.load_seconds:.3f}s wait, {out.load_gb_per_s:.2f} GB/s"
    return (f"prompt {out.num_prompt_tokens} tokens: {out.num_cached_tokens} cached{tiers}, "
            f"{replayed}{out.num_computed_tokens} computed; {len(out.token_ids)} generated{loaded}"
            f"{_spec_part(out)}")


def _spec_part(out) -> str:
    if not out.num_drafted_tokens:
        return ""
    mean = out.num_accepted_tokens / out.num_verify_steps if out.num_verify_steps else 0.0
    return (f"; speculative: {out.num_drafted_tokens} drafted, {out.num_verified_tokens} verified, "
            f"{out.num_accepted_tokens} accepted ({mean:.2f} per verify step)")


def cmd_chat(args: argparse.Namespace) -> int:
    from .llm import LLM

    llm = LLM.from_config(engine_config(args))
    params = sampling_params(args)
    session = llm.session()
    print("deepinfer chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        t0 = time.perf_counter()
        out = llm.generate(session.next_prompt(line), params)[0]
        session.add_reply(out.token_ids, out.text)
        print(f"assistant> {out.text}")
        print(f"[turn: {_cache_line(out)}, {time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    llm.engine.shutdown()
    return 0


# ---------------------------------------------------------------------- deepinfer cache
def _open_disk_store(args: argparse.Namespace):
    """The L3 directory for maintenance (every namespace, no capacity eviction); None if absent."""
    import os

    from .config import default_disk_dir
    from .kv.tiers.disk_store import DiskStore

    path = args.disk_cache_dir or str(default_disk_dir())
    if not os.path.isdir(path):
        _print_json({"dir": path, "files": 0, "note": "no such directory"})
        return None
    secret = args.kv_store_secret.encode() if args.kv_store_secret else None
    return DiskStore(path, 1 << 62, None, secret=secret)


def _print_json(obj: dict) -> None:
    import json

    print(json.dumps(obj, indent=2, sort_keys=True))


def cmd_cache_stats(args: argparse.Namespace) -> int:
    import os

    store = _open_disk_store(args)
    if store is None:
        return 0
    s = store.stats()
    qdir = os.path.join(store.path, "quarantine")
    quarantined = len(os.listdir(qdir)) if os.path.isdir(qdir) else 0
    _print_json({"dir": store.path, "files": s["entries"], "bytes": s["bytes"],
                 "gib": round(s["bytes"] / 2**30, 3), "quarantined_files": quarantined})
    return 0


def cmd_cache_verify(args: argparse.Namespace) -> int:
    store = _open_disk_store(args)
    if store is None:
        return 0
    report = store.verify(repair=args.repair)
    _print_json({"dir": store.path, **report})
    return 0 if report["ok"] == report["checked"] else 1


def cmd_cache_clear(args: argparse.Namespace) -> int:
    store = _open_disk_store(args)
    if store is None:
        return 0
    n = store.stats()["entries"]
    store.clear()
    _print_json({"dir": store.path, "removed_files": n})
    return 0


def read_prompts(path: str) -> list:
    """Prompts of a file: JSONL (a string, or an object with "prompt", "prompt_token_ids" or
    chat "messages" per line) or plain text, one prompt per line (blank lines skipped)."""
    import json

    out: list = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            item = line
            if line.lstrip()[:1] in ("{", "[", '"'):
                try:
                    item = json.loads(line)
                except ValueError:
                    item = line
            if isinstance(item, dict):
                item = item.get("messages") or item.get("prompt_token_ids") or item.get("prompt")
            if not item:
                raise ValueError(f"{path}: cannot read a prompt from line {line[:80]!r}")
            out.append(item)
    return out


def cmd_cache_warm(args: argparse.Namespace) -> int:
    """Prefill every prompt (max_tokens=1) so its pages reach the tiers, then flush."""
    from .chat import render_chat
    from .llm import LLM

    prompts = read_prompts(args.file)
    llm = LLM.from_config(engine_config(args))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    tokens = cached = 0
    for i in range(0, len(prompts), 16):
        batch = [render_chat(llm.tokenizer, p) if isinstance(p, list) and p and isinstance(p[0], dict)
                 else p for p in prompts[i : i + 16]]
        for out in llm.generate(batch, params):
            tokens += out.num_prompt_tokens
            cached += out.num_cached_tokens
    flushed = llm.engine.shutdown(timeout=None)
    stats = llm.engine.stats()
    _print_json({"prompts": len(prompts), "prompt_tokens": tokens, "already_cached_tokens": cached,
                 "seconds": round(time.perf_counter() - t0, 3), "flushed": flushed,
                 "disk_files": stats.get("cache_disk_files", 0),
                 "disk_bytes_written": stats.get("cache_bytes_written_by_tier", {}).get("disk", 0)})
    return 0 if flushed else 1


def add_cache_subcommands(sub: argparse._SubParsersAction) -> None:
    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--disk-cache-dir", default=None, help="L3 directory (default: the engine's)")
        add_secret_arg(p)
        return p

    with_dir(sub.add_parser("stats", help="files and bytes in the L3 directory")).set_defaults(func=cmd_cache_stats)
    v = with_dir(sub.add_parser("verify", help="re-check every L3 file: format, the tag over header "
                                "and payload (a MAC with --kv-store-secret); exit 1 if any is bad"))
    v.add_argument("--repair", action="store_true",
                   help="quarantine the bad files (so their pages get written again) and remove "
                        "dead writers' temp files")
    v.set_defaults(func=cmd_cache_verify)
    with_dir(sub.add_parser("clear", help="delete every L3 page file")).set_defaults(func=cmd_cache_clear)
    w = sub.add_parser("warm", help="prefill prompts from a file (one per line, or JSONL) so "
                       "their KV is cached on L3 (e.g. a shared system prompt)")
    w.add_argument("file")
    add_engine_args(w)
    w.set_defaults(func=cmd_cache_warm)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.serve import run_server
    from .server.config import server_config

    if args.model_tag is not None:  # ``deepinfer serve MODEL``, as ``vllm serve MODEL``
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model "
                             f"{args.model!r}")
        args.model = args.model_tag
    return run_server(engine_config(args), server_config(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts (offline)")
    g.add_argument("prompt", nargs="*", help="prompt texts")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user turn")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat, showing cache hits per turn")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    from .bench.cli import add_plan_cache_parser, add_subcommands as add_bench_subcommands

    b = sub.add_parser("bench", help="benchmarks: workloads, trace replay, peers, ideal hit rates")
    add_bench_subcommands(b.add_subparsers(dest="bench_command", required=True))
    add_plan_cache_parser(sub)  # also top level: deepinfer plan-cache --trace FILE
    k = sub.add_parser("cache", help="the L3 KV cache directory: stats | verify | clear | warm")
    add_cache_subcommands(k.add_subparsers(dest="cache_command", required=True))
    from .server.config import add_server_args

    s = sub.add_parser("serve", help="OpenAI/DeepSeek-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="model to serve, as `vllm serve MODEL` (same as --model)")
    add_engine_args(s)
    add_server_args(s)
    s.set_defaults(func=cmd_serve)
    from .router.serve import add_router_parser

    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RequestError, ValueError, ImportError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
