"""Command line of the benchmark tools (``python -m deepinfer.bench ...``).

``deepinfer/cli.py`` can delegate with ``add_subcommands(subparsers)`` / ``main(argv)``.

* ``ideal TRACE...``: ideal (infinite-cache) hit rate of block traces, and how long it took.
* ``client``: a workload or a trace against OpenAI-compatible endpoints, one report column
  per endpoint.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="chat",
                   help="chat|agent|docqa|sharegpt|taubench|sweagent|trace")
    p.add_argument("--workload-args", default="{}", help="JSON kwargs for the workload builder")
    p.add_argument("--trace", default=None, help="block trace for --workload trace")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--token-low", type=int, default=256, help="smallest token id sent")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--run-max-requests", type=int, default=None)
    p.add_argument("--run-max-duration-s", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--generated-replies", action="store_true",
                   help="append the server's replies even where the dataset recorded one")
    p.add_argument("--out", default="results")
    p.add_argument("--run", default=None, help="results/<run> (default: timestamp)")
    p.add_argument("--no-progress", action="store_true")
    _add_scale_args(p)
    p.set_defaults(func=cmd_client)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-bench")
    add_subcommands(p.add_subparsers(dest="cmd", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    raise SystemExit(main())
