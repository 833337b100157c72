"""Command line: ``deepinfer generate | chat`` (and the subcommands other modules add)."""

from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .errors import RequestError
from .sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--num-pages", type=int, default=None, help="device KV pool size in pages")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--no-prefix-cache", action="store_true")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_cache=not args.no_prefix_cache)


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
        print(f"[prompt {out.num_prompt_tokens} tokens: {out.num_cached_tokens} cached, "
              f"{out.num_computed_tokens} computed; {len(out.token_ids)} generated, "
              f"finish={out.finish_reason}]", file=sys.stderr)
    return 0


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
        print(f"[turn: prompt {out.num_prompt_tokens} tokens, {out.num_cached_tokens} cached, "
              f"{out.num_computed_tokens} computed, {len(out.token_ids)} generated, "
              f"{time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    return 0


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
    from .bench.cli import add_subcommands as add_bench_subcommands

    b = sub.add_parser("bench", help="benchmarks: workloads, trace replay, peers, ideal hit rates")
    add_bench_subcommands(b.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RequestError, ValueError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
