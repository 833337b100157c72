"""Command line of the benchmark tools (``python -m deepinfer.bench ...``).

``deepinfer/cli.py`` can delegate with ``add_subcommands(subparsers)`` / ``main(argv)``.

* ``ideal TRACE...``: ideal (infinite-cache) hit rate of block traces, and how long it took.
* ``client``: a workload or a trace against OpenAI-compatible endpoints, one report column
  per endpoint.
* ``engine``: a workload or a trace through an in-process engine, one column per engine config
  (cache off, L1 only, all tiers, custom) plus a transformers ``generate`` baseline.
* ``plan-cache``: replay a trace through the engine's cache code with no model, over a grid of
  L1 / L2 / L3 capacities and page sizes; hit rate vs capacity and the smallest sizes that
  reach a target.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer.bench.traces import default_traces_dir, load_trace


def _add_scale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace scaling")
    g.add_argument("--token-scale", type=float, default=1.0, help="multiply block size and lengths")
    g.add_argument("--max-input-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None)
    g.add_argument("--time-compression", type=float, default=1.0,
                   help="divide arrival times (inf: all at once)")
    g.add_argument("--max-requests", type=int, default=None)
    g.add_argument("--max-duration-s", type=float, default=None,
                   help="keep requests arriving before this trace time")


def _scale_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "token_scale": a.token_scale,
        "max_input_tokens": a.max_input_tokens,
        "max_output_tokens": a.max_output_tokens,
        "time_compression": a.time_compression,
        "max_requests": a.max_requests,
        "max_duration_s": a.max_duration_s,
    }


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="chat",
                   help="chat|agent|docqa|sharegpt|taubench|sweagent|trace")
    p.add_argument("--workload-args", default="{}", help="JSON kwargs for the workload builder")
    p.add_argument("--trace", default=None, help="block trace for --workload trace")


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    """How to talk to OpenAI-compatible endpoints."""
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout-s", type=float, default=300.0)


def _add_run_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-max-requests", type=int, default=None)
    p.add_argument("--run-max-duration-s", type=float, default=None)


def _add_results_args(p: argparse.ArgumentParser, out: str, run_help: str) -> None:
    p.add_argument("--out", default=out)
    p.add_argument("--run", default=None, help=run_help)
    p.add_argument("--no-progress", action="store_true")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ideal", help="ideal (infinite cache) hit rate of block traces")
    p.add_argument("traces", nargs="*", help="trace files/folders (default: all known traces)")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    _add_scale_args(p)
    p.set_defaults(func=cmd_ideal)

    p = sub.add_parser("client", help="drive a workload against OpenAI-compatible endpoints")
    p.add_argument("--endpoint", action="append", default=[], metavar="LABEL=URL",
                   help="repeatable; one report column each")
    p.add_argument("--base-url", default=None, help="single endpoint (label: the model name)")
    p.add_argument("--model", action="append", default=[], metavar="[LABEL=]MODEL")
    _add_workload_args(p)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--token-low", type=int, default=256, help="smallest token id sent")
    p.add_argument("--concurrency", type=int, default=8)
    _add_peer_args(p)
    _add_run_limit_args(p)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--generated-replies", action="store_true",
                   help="append the server's replies even where the dataset recorded one")
    _add_results_args(p, "results", "results/<run> (default: timestamp)")
    _add_scale_args(p)
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("engine", help="drive a workload through an in-process engine, "
                                      "one column per engine config")
    _add_workload_args(p)
    p.add_argument("--token-low", type=int, default=256, help="smallest token id of trace prompts")
    p.add_argument("--configs", default="off,l1,all",
                   help="comma list of presets (off, l1, all) or names given with --config")
    p.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                   help="custom config: EngineConfig kwargs (repeatable)")
    p.add_argument("--baseline", default="transformers", help="transformers | none")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--engine-args", default="{}",
                   help="JSON EngineConfig kwargs shared by every config (page_size, num_pages...)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every column N times, interleaved; keep each one's median run")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="requests in the engine at once (default: unbounded)")
    p.add_argument("--idle", choices=["sleep", "skip"], default="sleep",
                   help="engine idle before the next arrival: wait for it, or skip the gap")
    _add_run_limit_args(p)
    p.add_argument("--respect-eos", action="store_true",
                   help="stop at EOS (default: generate exactly max_tokens: equal work per column)")
    p.add_argument("--generated-replies", action="store_true",
                   help="append the model's replies even where the dataset recorded one")
    p.add_argument("--tool-format", choices=["auto", "openai", "text"], default="auto")
    p.add_argument("--endpoint", action="append", default=[], metavar="LABEL=URL",
                   help="also run the workload against an OpenAI-compatible server (e.g. "
                        "llama.cpp's) as one more column of the same report (repeatable)")
    p.add_argument("--endpoint-model", default="default", help="model name sent to endpoints")
    _add_peer_args(p)
    _add_results_args(p, "results", "results/<run> (default: timestamp)")
    _add_scale_args(p)
    p.set_defaults(func=cmd_engine)

    add_plan_cache_parser(sub)


def add_plan_cache_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``plan-cache`` (also ``deepinfer plan-cache``)."""
    p = sub.add_parser("plan-cache", help="cache capacity planner: hit rate vs L1/L2/L3 size, "
                                          "no model")
    p.add_argument("--trace", required=True, help="block trace file or kv-cache-tester folder")
    p.add_argument("--page-sizes", default="512", help="comma list (default 512)")
    p.add_argument("--l1", default="1M,2M,5M,10M,20M,50M,100M,200M",
                   help="L1 capacities in tokens, comma list (k/M/G suffixes), or LO:HI:N "
                        "for N log-spaced sizes")
    p.add_argument("--l2", default="0", help="L2 (host) capacities in tokens, as --l1")
    p.add_argument("--l3", default="0", help="L3 (disk) capacities in tokens, as --l1")
    p.add_argument("--target", type=str, default=None,
                   help="hit rate to reach (0.9 or 90%%): report the smallest sizes reaching it")
    p.add_argument("--target-of-ideal", type=str, default=None,
                   help="target as a fraction of the trace's ideal hit rate (0.9 or 90%%)")
    p.add_argument("--refine", action="store_true",
                   help="bisect the smallest L1 reaching --target between grid points")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight (they complete in arrival order)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill chunk (the engine's max_num_batched_tokens; default 2048)")
    p.add_argument("--max-node-pages", type=int, default=None)
    p.add_argument("--prefill-only", action="store_true",
                   help="replies take no cache room (default: their pages are cached too)")
    p.add_argument("--policy", default="write_through",
                   help="lower tiers: write_through | write_back | selective")
    p.add_argument("--selective-hits", type=int, default=2)
    p.add_argument("--kv-bytes-per-token", type=float, default=None,
                   help="report bytes moved between tiers (see python -m deepinfer.models.kv_size)")
    _add_results_args(p, "results/planner", "<out>/<run> (default: the trace name)")
    p.add_argument("--no-plot", action="store_true")
    _add_scale_args(p)
    p.set_defaults(func=cmd_plan_cache)
    return p


def known_traces() -> list[Path]:
    base = default_traces_dir()
    if base is None:
        return []
    names = ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl",
             "derived_sharegpt_blk64.jsonl", "derived_taubench_airline_blk64.jsonl",
             "derived_sweagent_demos_blk64.jsonl", "derived_leval_docqa_blk64.jsonl",
             "kv-cache-tester"]
    return [base / n for n in names if (base / n).exists()]


def cmd_ideal(a: argparse.Namespace) -> int:
    from deepinfer.bench.ideal import ideal_hits

    paths = [Path(p) for p in a.traces] or known_traces()
    if not paths:
        print("no traces given and none found (set DEEPINFER_TRACES)", file=sys.stderr)
        return 2
    for path in paths:
        t0 = time.perf_counter()
        reqs = load_trace(path, **_scale_kwargs(a))
        load_s = time.perf_counter() - t0
        res = ideal_hits(reqs)
        row = {"trace": path.name, **res.as_dict(), "load_seconds": load_s}
        if a.json:
            print(json.dumps(row))
        else:
            print(f"{path.name:42s} {row['requests']:>7,d} req {row['input_tokens']:>13,d} tok  "
                  f"ideal {100 * row['ideal_hit_rate']:5.1f}%  "
                  f"(ideal {res.seconds:.2f}s, load {load_s:.2f}s)")
    return 0


def _labelled(items: list[str]) -> dict[str | None, str]:
    out: dict[str | None, str] = {}
    for it in items:
        if "=" in it and not it.startswith(("http://", "https://")):
            k, v = it.split("=", 1)
            out[k] = v
        else:
            out[None] = it
    return out


def cmd_client(a: argparse.Namespace) -> int:
    from deepinfer.bench.client import ClientConfig, run_workload
    from deepinfer.bench.report import write_report
    from deepinfer.bench.workloads import make_workload, workload_from_trace

    models = _labelled(a.model)
    endpoints = _labelled(a.endpoint)
    if a.base_url:
        endpoints[models.get(None, "endpoint")] = a.base_url
    endpoints.pop(None, None)
    if not endpoints:
        print("give --endpoint LABEL=URL or --base-url", file=sys.stderr)
        return 2
    meta: dict[str, Any] = {"workload": a.workload}
    if a.workload == "trace":
        if not a.trace:
            print("--workload trace needs --trace", file=sys.stderr)
            return 2
        reqs = load_trace(a.trace, **_scale_kwargs(a))
        wl = workload_from_trace(reqs, vocab_size=a.vocab_size, low=a.token_low,
                                 name=Path(a.trace).name)
        meta.update(trace=str(a.trace), **{
            k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in _scale_kwargs(a).items() if v is not None})
    else:
        wl = make_workload(a.workload, **json.loads(a.workload_args))
        meta["workload_args"] = a.workload_args
    meta["requests"] = wl.num_requests
    configs = {}
    for label, url in endpoints.items():
        cfg = ClientConfig(
            base_url=url, model=models.get(label, models.get(None, "default")),
            api_key=a.api_key, concurrency=a.concurrency,
            request_timeout_s=a.request_timeout_s, max_requests=a.run_max_requests,
            max_duration_s=a.run_max_duration_s, ignore_eos=a.ignore_eos,
            use_recorded_replies=not a.generated_replies, progress=not a.no_progress)
        configs[label] = run_workload(cfg, wl)
        meta[f"endpoint {label}"] = f"{url} (model {cfg.model})"
    run = a.run or time.strftime("client-%Y%m%d-%H%M%S")
    doc = write_report(Path(a.out) / run, configs, meta=meta)
    print((Path(a.out) / run / "summary.md").read_text())
    return 0 if all(s["num_errors"] == 0 for s in doc["configs"].values()) else 1


def _meta_scale(a: argparse.Namespace) -> dict[str, Any]:
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in _scale_kwargs(a).items() if v is not None}


def cmd_engine(a: argparse.Namespace) -> int:
    from deepinfer.bench.driver import DriveOptions
    from deepinfer.bench.engine_bench import (
        default_baseline_column,
        resolve_configs,
        run_engine_bench,
        write_engine_report,
    )
    from deepinfer.bench.workloads import make_workload, workload_from_trace

    run = a.run or time.strftime("engine-%Y%m%d-%H%M%S")
    run_dir = Path(a.out) / run
    custom = {}
    for item in a.config:
        if "=" not in item:
            print(f"--config wants NAME=JSON, got {item!r}", file=sys.stderr)
            return 2
        k, v = item.split("=", 1)
        custom[k] = json.loads(v)
    names = [n for n in a.configs.split(",") if n] if a.configs else []
    names += [n for n in custom if n not in names]
    configs, skipped = resolve_configs(names, custom, run_dir=str(run_dir))
    engine_args = json.loads(a.engine_args)
    if a.model:
        engine_args["model"] = a.model
    meta: dict[str, Any] = {"workload": a.workload}
    if a.workload == "trace":
        if not a.trace:
            print("--workload trace needs --trace", file=sys.stderr)
            return 2
        reqs = load_trace(a.trace, **_scale_kwargs(a))
        meta.update(trace=str(a.trace), **_meta_scale(a))

        def factory(vocab: int):
            return workload_from_trace(reqs, vocab_size=vocab, low=min(a.token_low, vocab - 1),
                                       name=Path(a.trace).name)
    else:
        wl = make_workload(a.workload, **json.loads(a.workload_args))
        meta["workload_args"] = a.workload_args

        def factory(vocab: int):
            return wl
    baseline = None if a.baseline in ("", "none") else a.baseline
    opts = DriveOptions(max_in_flight=a.max_in_flight,
                        use_recorded_replies=not a.generated_replies, tool_format=a.tool_format,
                        idle=a.idle, max_requests=a.run_max_requests,
                        max_duration_s=a.run_max_duration_s, progress=not a.no_progress)
    if not configs and not baseline and not [e for e in a.endpoint if "=" in e]:
        for n, why in skipped.items():
            print(f"config {n!r}: {why}", file=sys.stderr)
        print("nothing to run", file=sys.stderr)
        return 2
    endpoints = _labelled(a.endpoint)
    endpoints.pop(None, None)
    res = run_engine_bench(factory, configs, engine_args=engine_args, baseline=baseline,
                           skipped=skipped, ignore_eos=not a.respect_eos, opts=opts,
                           log=lambda m: print(m, file=sys.stderr), run_dir=run_dir,
                           rounds=a.rounds)
    if endpoints:
        from deepinfer.bench.client import ClientConfig, run_workload
        from deepinfer.bench.driver import DriveResult
        from deepinfer.bench.sessions import Workload, apply_tool_format

        wl_used = res.workload if isinstance(res.workload, Workload) else factory(32000)
        if a.tool_format == "text":  # the engine columns rendered tools as text: so must the peers
            wl_used = apply_tool_format(copy.deepcopy(wl_used), "text")
        for label, url in endpoints.items():
            cfg = ClientConfig(base_url=url, model=a.endpoint_model, api_key=a.api_key,
                               concurrency=a.max_in_flight or 8,
                               request_timeout_s=a.request_timeout_s,
                               max_requests=a.run_max_requests,
                               max_duration_s=a.run_max_duration_s, ignore_eos=not a.respect_eos,
                               use_recorded_replies=not a.generated_replies,
                               progress=not a.no_progress)
            recs = run_workload(cfg, wl_used)
            res.results[label] = DriveResult(records=recs, duration_s=None, stats={})
            meta[f"endpoint {label}"] = url
    first = next(iter(res.results.values()), None)
    if first is not None:
        meta["requests"] = len(first.records)
    meta["idle"] = a.idle
    if a.rounds > 1:
        meta["rounds"] = f"{a.rounds}, interleaved; each column's median-duration run"
    meta["ignore_eos"] = not a.respect_eos
    doc = write_engine_report(run_dir, res, meta=meta,
                              baseline_column=default_baseline_column(list(res.results)))
    print((run_dir / "summary.md").read_text())
    return 0 if all(s["num_errors"] == 0 for s in doc["configs"].values()) else 1


def _capacities(spec: str) -> list[int]:
    from deepinfer.bench.sweep import log_grid, parse_tokens

    spec = spec.strip()
    if ":" in spec:
        lo, hi, n = spec.split(":")
        return log_grid(parse_tokens(lo), parse_tokens(hi), int(n))
    return sorted({parse_tokens(x) for x in spec.split(",") if x.strip()})


def _fraction(s: str | None) -> float | None:
    if s is None:
        return None
    s = s.strip()
    return float(s[:-1]) / 100 if s.endswith("%") else float(s)


def cmd_plan_cache(a: argparse.Namespace) -> int:
    from deepinfer.bench.plan_report import write_plan_report
    from deepinfer.bench.sweep import plan

    t0 = time.perf_counter()
    reqs = load_trace(a.trace, **_scale_kwargs(a))
    load_s = time.perf_counter() - t0
    kw: dict[str, Any] = {"concurrency": a.concurrency, "outputs": not a.prefill_only,
                          "policy": a.policy, "selective_hits": a.selective_hits,
                          "kv_bytes_per_token": a.kv_bytes_per_token}
    if a.chunk_tokens is not None:
        kw["chunk_tokens"] = a.chunk_tokens
    if a.max_node_pages is not None:
        kw["max_node_pages"] = a.max_node_pages
    name = Path(a.trace).name
    rep = plan(reqs, page_sizes=[int(x) for x in a.page_sizes.split(",")],
               l1=_capacities(a.l1), l2=_capacities(a.l2), l3=_capacities(a.l3),
               target=_fraction(a.target), target_of_ideal=_fraction(a.target_of_ideal),
               refine=a.refine, name=name,
               progress=not a.no_progress, **kw)
    rep.meta["load_seconds"] = load_s
    rep.meta.update(_meta_scale(a))
    out = Path(a.out) / (a.run or Path(a.trace).stem)
    write_plan_report(out, rep, plots=not a.no_plot)
    print((out / "plan.md").read_text())
    print(f"written to {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-bench")
    add_subcommands(p.add_subparsers(dest="cmd", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    raise SystemExit(main())
