"""Speculative decoding's decisions replayed under measured step prices, load-independent.

On a shared CPU a wall-clock run of ``spec.py`` swings by more than the few percent that
separate the modes on plain chat. This replays them instead: greedy speculation in float32
emits exactly the tokens of greedy decoding, so the tokens a verify step accepts are the
longest prefix of its draft that equals the reference output. Each mode (``spec.py``'s k=3,
k=5, scheduled and auto configs) runs its real draft sources, calibrator and Algorithm 1 over
the reference outputs, and every step is charged its price: the single-thread CPU time
(``time.thread_time``, which other processes' load barely moves) of a B-token step over a
1-token decode, measured at a few context lengths on the real model and interpolated
between them. The scheduler sees what the engine would: a profile measured at the warm-up's
context and refined by the steps it runs (``SpsProfile.observe``). Reported: modelled speed-up
over off (decode steps' total price), verified and accepted tokens, per workload and mode,
prompts in ``spec.py``'s order (one engine per mode answers all of them). ``--trace agent``
prints each of that workload's steps; ``--noise`` slows the steps the profile observes, as
load does, step by step, and ``--drift`` as a load that moves between levels every
``DRIFT_STEPS`` observed steps; ``--prices FILE`` reuses the prices a run saved there (replays comparable across
code versions).

    python benchmarks/spec_replay.py [--dtype auto] [--contexts 40,150,400] [--max-tokens 160]
                                     [--repeats 2] [--rounds 6] [--modes k=5,scheduled]
                                     [--trace agent] [--noise 0.1] [--prices FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from bisect import bisect_left
from pathlib import Path

from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.calibration import Calibrator
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.profile import SIZES
from deepinfer.spec.step import weight_free_source
from deepinfer.spec.verify_schedule import SpsProfile, plan_verify
from spec import WARM_UP, WORKLOADS, modes

MAX_B = 17  # step tokens priced (a verify span of up to 16 draft tokens)
DRIFT_STEPS = 20  # --drift: observed steps under one load level (not a multiple of a profile window)
ENGINE = dict(kv_cache_memory_gb=0.5, host_cache_gb=0, enable_disk_cache=False,
              enable_prefix_cache=False, progress=False, threads=1)


def references(max_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(workload, prompt ids, greedy float32 output ids): the warm-up, then every prompt."""
    llm = LLM(None, dtype="float32", speculative_config=SpeculativeConfig(method="none"), **ENGINE)
    asks = [("warm-up", WARM_UP, 16)] + [(wl, p, max_tokens) for wl, ps in WORKLOADS.items() for p in ps]
    out = []
    for wl, prompt, n in asks:
        o = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=n, temperature=0.0))[0]
        out.append((wl, o.prompt_token_ids, o.token_ids))
    llm.engine.shutdown()
    return out


def step_prices(dtype: str, contexts: list[int], rounds: int) -> dict[int, list[float]]:
    """Per context: CPU time of a 1..MAX_B-token step over a 1-token one (median of rounds)."""
    llm = LLM(None, dtype=dtype, speculative_config=SpeculativeConfig(method="none"), **ENGINE)
    engine, out = llm.engine, {}
    for ctx in contexts:
        req = engine.add_request(list(range(100, 100 + ctx)),
                                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while not req.output_token_ids:
            engine.step()
        assert engine.kv.allocate(req, MAX_B)

        def cpu(b: int) -> float:
            req.output_token_ids += [req.all_token_ids[-1]] * (b - 1)
            t0 = time.thread_time()
            engine.runner.forward_spans([(req, b)], {req: b} if b > 1 else {})
            seconds = time.thread_time() - t0
            del req.output_token_ids[len(req.output_token_ids) - (b - 1):]
            return seconds

        times = [[cpu(b) for b in range(1, MAX_B + 1)] for _ in range(rounds + 1)][1:]
        ratios = [statistics.median(r[b] / r[0] for r in times) for b in range(MAX_B)]
        out[ctx] = [max(ratios[: b + 1]) for b in range(MAX_B)]  # more tokens never cost less
        engine.abort(req.request_id)
        while engine.has_unfinished():
            engine.step()
    engine.shutdown()
    return out


def price(prices: dict[int, list[float]], b: int, ctx: int) -> float:
    """A ``b``-token step's price at context ``ctx``: linear between the measured contexts."""
    cs = sorted(prices)
    ctx = min(max(ctx, cs[0]), cs[-1])
    i = min(max(bisect_left(cs, ctx), 1), len(cs) - 1) if len(cs) > 1 else 0
    lo, hi = cs[max(i - 1, 0)], cs[i]
    w = 0.0 if hi == lo else (ctx - lo) / (hi - lo)
    b = min(b, MAX_B) - 1
    return prices[lo][b] * (1 - w) + prices[hi][b] * w


def replay(sc: SpeculativeConfig, refs: list[tuple[str, list[int], list[int]]],
           prices: dict[int, list[float]], trace: str | None = None, noise: float = 0.0,
           drift: float = 0.0) -> dict[str, tuple[float, int, int]]:
    """One mode over the prompts in order: per workload (speed-up, verified, accepted); every
    step of workload ``trace`` is printed (context, draft features, confidences, the profile's
    step prices, verified and accepted tokens), to see why the scheduler verified what it did.
    ``noise``: the profile observes each step's price times 1 + noise * E, E ~ Exp(1) seeded
    (load only slows a step, now and then much), while the step is charged its price.
    ``drift``: the observed steps are also slowed by a level drawn from 1..1 + drift (seeded),
    a new one every ``DRIFT_STEPS`` steps."""
    calibrator = Calibrator(sc.calibration_window)
    source, _ = weight_free_source(sc, calibrator)
    warm = len(refs[0][1]) + len(refs[0][2])
    sizes = [b for b in SIZES if b <= sc.num_tokens + 1]
    start = SpsProfile(sizes, [1.0 / price(prices, b, warm) for b in sizes])
    dense = list(range(1, sc.num_tokens + 2))
    sps = SpsProfile(dense, [start(b) for b in dense])
    totals: dict[str, list[float]] = {}
    rng, drift_rng, level, steps = random.Random(0), random.Random(1), 1.0, 0
    for wl, prompt, ref in refs:
        req = Request(wl, list(prompt), SamplingParams(max_tokens=len(ref), temperature=0.0))
        req.output_token_ids = ref[:1]  # the prefill's token: not a decode step
        cost = 0.0
        while (done := len(req.output_token_ids)) < len(ref):
            room = min(sc.num_tokens, len(ref) - done - 1)
            draft = source.propose_batch([(req, room)])[0] if room > 0 else None
            n = 0
            if draft is not None and draft.tokens:
                n = (plan_verify([calibrator.survival(draft.source, draft.features)], sps)[0]
                     if sc.scheduled else len(draft.tokens))
            accepted = 0
            if wl == trace and draft is not None and draft.tokens:
                conf = calibrator.confidences(draft.source, draft.features)
                ratios = [1 / (sps(b) * sps.seconds[0]) for b in range(2, len(draft.tokens) + 2)]
                same = itertools.takewhile(lambda t: t[0] == t[1], zip(draft.tokens, ref[done:]))
                print_step(req.num_tokens, draft.features, conf, ratios, n, len(list(same)))
            if n:
                draft = draft.head(n)
                while accepted < n and draft.tokens[accepted] == ref[done + accepted]:
                    accepted += 1
                calibrator.update(draft.source, draft.features, accepted)
                req.spec.verified += n
                req.spec.accepted += accepted
            p = price(prices, 1 + n, req.num_tokens)
            if steps % DRIFT_STEPS == 0:
                level = 1.0 + drift * drift_rng.random()
            steps += 1
            sps.observe(1 + n, p * level * (1 + noise * rng.expovariate(1.0)))
            cost += p
            req.output_token_ids += ref[done : done + accepted + 1]
        source.finished(req)
        if wl != "warm-up":
            t = totals.setdefault(wl, [0.0, 0.0, 0, 0])
            t[0] += len(ref) - 1
            t[1] += cost
            t[2] += req.spec.verified
            t[3] += req.spec.accepted
    return {wl: (t[0] / t[1], int(t[2]), int(t[3])) for wl, t in totals.items()}


def print_step(ctx: int, features: list[int], conf: list[float], ratios: list[float],
               verified: int, matching: int) -> None:
    """One traced step: the draft's features and confidences c_j, the profile's price of a
    B-token step over its 1-token one for B = 2.., and how many tokens were verified and how
    many of the draft match the reference (what verifying all of it would have accepted)."""
    print(f"step ctx {ctx} features {features} c {' '.join(f'{c:.2f}' for c in conf)} "
          f"price {' '.join(f'{r:.2f}' for r in ratios)} verified {verified} matching {matching}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto", help="the dtype whose step prices are measured")
    ap.add_argument("--contexts", default="40,150,400")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (spec.py's order)")
    ap.add_argument("--noise", type=float, default=0.0, help="mean slow-down of the observed steps")
    ap.add_argument("--drift", type=float, default=0.0, help="the observed steps' load level: 1..1 + this")
    ap.add_argument("--trace", default=None, help="print every step of this workload")
    ap.add_argument("--modes", default=None, help="comma-separated subset of k=3,k=5,scheduled,auto")
    ap.add_argument("--prices", default=None, help="JSON file: read the step prices, or save them")
    ap.add_argument("--rounds", type=int, default=6, help="price measurements per step size")
    args = ap.parse_args()
    refs = references(args.max_tokens)
    saved = Path(args.prices) if args.prices else None
    if saved is not None and saved.exists():
        prices = {int(c): row for c, row in json.loads(saved.read_text()).items()}
    else:
        prices = step_prices(args.dtype, [int(c) for c in args.contexts.split(",")], args.rounds)
        if saved is not None:
            saved.write_text(json.dumps(prices))
    order = refs[:1] + [r for wl in WORKLOADS for _ in range(args.repeats) for r in refs[1:] if r[0] == wl]
    print(f"CPU: {lscpu_model()}; step prices: dtype {args.dtype}, 1 thread, CPU time; "
          f"{args.max_tokens} tokens, {args.repeats} passes, noise {args.noise}, drift {args.drift}")
    for ctx, row in prices.items():
        print(f"price at context {ctx}: " + " ".join(f"{p:.3f}" for p in row))
    print("| workload | mode | modelled speed-up | verified | accepted |\n|---|---|---:|---:|---:|")
    for mode, sc in modes("ngram", None, None).items():
        if sc is None or (args.modes is not None and mode not in args.modes.split(",")):
            continue
        if args.trace:
            print(f"trace of {mode} on {args.trace}:")
        results = replay(sc, order, prices, args.trace, args.noise, args.drift)
        for wl, (speedup, verified, accepted) in results.items():
            print(f"| {wl} | {mode} | {speedup:.3f} | {verified} | {accepted} |", flush=True)


if __name__ == "__main__":
    main()
