"""Speculative decoding: off vs fixed k=3 vs fixed k=5 vs scheduled (Algorithm 1) vs
`auto` (SpeculativeConfig(): both weight-free sources, scheduled), one run.

Workloads (one user at a time, greedy, chat template): ``code`` (rewrite a given Python file
with one small change: the reply mostly copies the prompt), ``agent`` (answer from a tool output
pasted in the prompt, quoting it) and ``chat`` (a plain question, little to copy). Every mode
runs in its own engine, built up front, and the modes take turns on each prompt (interleaved),
so a busy machine slows them alike; each engine first answers one short warm-up prompt, not
counted (where the scheduled mode measures its SPS profile for short contexts). Reported per
workload and mode: per-user decode tok/s (generated tokens after the first / time after the
first token), total seconds, drafted,
verified and accepted tokens, mean accepted per verify step, speed-up over off, and whether the
greedy output equals off's token for token.

    python benchmarks/spec.py [--model PATH] [--max-tokens 256] [--repeats 3] [--method ngram]
                              [--dtype auto] [--quantization none|int8|int4] [--temperature T]
                              [--users N] [--quick] [--draft-model PATH|self [--draft-quantization int4]]

``--quick``: 96 tokens, one repeat, the first prompt of each workload. ``--modes off,k=5,auto``
runs only those (off always; each mode holds an engine, so fewer take less memory). Besides
the speed-up of the summed times, ``round_speedup`` is the median over rounds (one prompt,
every mode back to back) of each round's ratio to off: a burst of load from other processes
that hits one mode's turn moves the sum, not the median; ``round_range`` is their spread (each
round's per-user decode tok/s per mode is in the summary's ``rounds``). ``--users N`` sends N
copies of each prompt at once (a batch of N; per-user figures are their mean). With
``--temperature`` > 0 (seeded) outputs are not compared (a different draw is not a difference).

``--draft-model`` adds a ``draft k=4`` mode (method draft_model; ``self``: the target model as
its own draft, e.g. int4-quantized). SmolLM2-135M has no smaller sibling available offline, so
the default run has no draft-model mode.

Writes results/spec/summary.json and prints a markdown table with the CPU model name.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig

CODE = '''import json
import statistics
from pathlib import Path


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    return data


def save_config(path, data):
    Path(path).write_text(json.dumps(data, indent=2))


def merge_configs(base, override):
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_configs(out[key], value)
        else:
            out[key] = value
    return out
'''
TOOL_OUTPUT = "\n".join(f"{name:<24}{size:>8} bytes  modified 2026-11-{day:02d}" for name, size, day in [
    ("engine.py", 11840, 3), ("scheduler.py", 4210, 7), ("model_runner.py", 6020, 9),
    ("README.md", 22100, 12), ("config.py", 4400, 14), ("cache_manager.py", 13200, 17),
    ("radix.py", 12480, 18), ("setup.sh", 900, 21), ("server.py", 9800, 22)])
WORKLOADS = {
    "code": ["Rename the function load_config to read_config everywhere in this file and output "
             "the whole updated file, nothing else.\n\n" + CODE,
             "Add a docstring to save_config and output the whole file, nothing else.\n\n" + CODE],
    "agent": ["The tool `ls -l src/` returned:\n" + TOOL_OUTPUT +
              "\n\nList every .py file with its size and date, one per line, exactly as shown.",
              "The tool `ls -l src/` returned:\n" + TOOL_OUTPUT +
              "\n\nCopy the lines of the files modified after 2026-11-10, exactly as shown."],
    "chat": ["Explain in a few paragraphs why the sky is blue.",
             "Give me three tips for learning to play the guitar."],
}

WARM_UP = "Say hello."


def modes(method: str, draft: str | None, draft_quantization: str | None
          ) -> dict[str, SpeculativeConfig | None]:
    out: dict[str, SpeculativeConfig | None] = {
        "off": None,  # built first, with method none
        "k=3": SpeculativeConfig(method=method, num_tokens=3, scheduled=False),
        "k=5": SpeculativeConfig(method=method, num_tokens=5, scheduled=False),
        "scheduled": SpeculativeConfig(method=method, num_tokens=8, scheduled=True),
        "auto": SpeculativeConfig()}  # method auto, scheduled, k <= 8
    if draft is not None:
        out["draft k=4"] = SpeculativeConfig(method="draft_model", model=draft, num_tokens=4,
                                             scheduled=False, draft_quantization=draft_quantization)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix", "auto"])
    ap.add_argument("--draft-model", default=None, help="adds a draft-model mode; self: the target")
    ap.add_argument("--draft-quantization", default=None, choices=["none", "int8", "int4"])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--users", type=int, default=1, help="copies of each prompt sent at once")
    ap.add_argument("--quick", action="store_true", help="96 tokens, 1 repeat, 1 prompt per workload")
    ap.add_argument("--modes", default=None, help="comma-separated subset of off,k=3,k=5,scheduled,auto")
    ap.add_argument("--out", default="results/spec")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 96, 1
    engine_args = dict(dtype=args.dtype, quantization=args.quantization, kv_cache_memory_gb=0.5, host_cache_gb=0, enable_disk_cache=False,
                       enable_prefix_cache=False, progress=False)
    llms = {"off": LLM(args.model, speculative_config=SpeculativeConfig(method="none"), **engine_args)}
    draft = str(llms["off"].engine.checkpoint_path) if args.draft_model == "self" else args.draft_model
    wanted = None if args.modes is None else set(args.modes.split(","))
    for m, sc in modes(args.method, draft, args.draft_quantization).items():
        if sc is not None and (wanted is None or m in wanted):
            llms[m] = LLM(args.model, speculative_config=sc, **engine_args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    for llm in llms.values():  # not counted: the scheduled mode measures its SPS profile here
        llm.chat([{"role": "user", "content": WARM_UP}], SamplingParams(max_tokens=16, temperature=0.0))
    rows, rounds = [], {}
    for wl in args.workloads.split(","):
        acc = {m: dict(decode_s=0.0, decoded=0, total_s=0.0, drafted=0, verified=0, accepted=0,
                       steps=0, identical=True, rounds=[]) for m in llms}
        for _ in range(args.repeats):
            for prompt in WORKLOADS[wl][:1] if args.quick else WORKLOADS[wl]:
                ref = None
                for m, llm in llms.items():  # modes interleaved on every prompt
                    outs = llm.chat([[{"role": "user", "content": prompt}]] * args.users, params)
                    a = acc[m]
                    a["rounds"].append(sum(len(o.token_ids) - 1 for o in outs)
                                       / sum(o.latency - o.ttft for o in outs))
                    for out in outs:
                        a["decode_s"] += (out.latency - out.ttft) / args.users
                        a["decoded"] += (len(out.token_ids) - 1) / args.users
                        a["total_s"] += out.latency / args.users
                        for k, v in (("drafted", out.num_drafted_tokens), ("verified", out.num_verified_tokens),
                                     ("accepted", out.num_accepted_tokens), ("steps", out.num_verify_steps)):
                            a[k] += v
                    ids = [out.token_ids for out in outs]
                    ref = ids if ref is None else ref
                    a["identical"] &= ids == ref
        base = acc["off"]["decoded"] / acc["off"]["decode_s"]
        rounds[wl] = {m: a["rounds"] for m, a in acc.items()}
        for m, a in acc.items():
            tps = a["decoded"] / a["decode_s"]
            per_round = [t / o for t, o in zip(a["rounds"], acc["off"]["rounds"])]
            rows.append(dict(workload=wl, mode=m, decode_tok_s=round(tps, 2),
                             speedup=round(tps / base, 3), round_speedup=round(statistics.median(per_round), 3),
                             round_range=f"{min(per_round):.2f}-{max(per_round):.2f}",
                             total_s=round(a["total_s"], 2),
                             drafted=a["drafted"], verified=a["verified"], accepted=a["accepted"],
                             acceptance=round(a["accepted"] / a["verified"], 3) if a["verified"] else 0.0,
                             accepted_per_step=round(a["accepted"] / a["steps"], 2) if a["steps"] else 0.0,
                             identical_to_off=a["identical"] if args.temperature == 0 else None))
            print(json.dumps(rows[-1]), flush=True)  # progress: one line per mode as it is done
    cpu = lscpu_model()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(dict(cpu=cpu, args=vars(args), rows=rows, rounds=rounds), indent=2))
    print(f"CPU: {cpu}; method {args.method}, max_tokens {args.max_tokens}, repeats {args.repeats}, "
          f"dtype {args.dtype}, quantization {args.quantization}, temperature {args.temperature}, "
          f"users {args.users}"
          + (f", draft {args.draft_model} ({args.draft_quantization or 'as the target'})"
             if args.draft_model else ""))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    for llm in llms.values():
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
