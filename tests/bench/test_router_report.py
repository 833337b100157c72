"""benchmarks/router.py's aggregation (router_report.py) and its kv-variant config names: the
rounds pool exactly (hits per tier too), the bootstrap interval brackets the percentile and is
reproducible, and a TTFT ratio, bootstrapped paired by request, is called a win or a loss only
when its whole interval is on one side of 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks"


def _load(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # router.py imports router_report by name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"bench_{name}", mod)
    spec.loader.exec_module(mod)
    return mod


def _run(ttft: list[float], prompt: int, cached: int, by_tier: dict[str, int] | None = None
         ) -> dict:
    return {"hit_rate": cached / prompt, "total_s": 1.0, "ttft_s": ttft, "requests": len(ttft),
            "errors": 0, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_tokens_by_tier": by_tier or {"device": cached},
            "ttft_by_request": {f"r{i}": t for i, t in enumerate(ttft)}}


def test_rounds_pool_and_the_interval_brackets_the_percentile(monkeypatch):
    rep = _load("router_report", monkeypatch)
    a = rep.aggregate([_run([1.0, 2.0, 3.0], 100, 50), {"failed": "no worker"},
                       _run([4.0, 5.0], 300, 250, {"device": 200, "disk": 50})])
    assert a["rounds"] == 2 and a["failed"] == ["no worker"]
    assert (a["prompt_tokens"], a["cached_tokens"], a["hit_rate"]) == (400, 300, 0.75)
    assert a["cached_tokens_by_tier"] == {"device": 250, "disk": 50}
    # request keys carry their round, so rounds with the same request ids stay apart
    assert a["ttft_by_request"] == {"0/r0": 1.0, "0/r1": 2.0, "0/r2": 3.0, "2/r0": 4.0,
                                    "2/r1": 5.0}
    assert a["round_ttft_p50_s"] == [2.0, 4.5] and a["requests"] == 5
    p50, lo, hi = a["ttft_p50"]
    assert p50 == 3.0 and 1.0 <= lo <= p50 <= hi <= 5.0
    assert rep.percentile_ci([1.0, 2.0, 3.0, 4.0], 50) == rep.percentile_ci([1.0, 2.0, 3.0, 4.0], 50)


def _keyed(values: list[float]) -> dict[str, float]:
    return {f"k{i}": v for i, v in enumerate(values)}


def test_a_ratio_is_decided_only_outside_one(monkeypatch):
    rep = _load("router_report", monkeypatch)
    fast, slow = [1.0 + i / 100 for i in range(30)], [2.0 + i / 100 for i in range(30)]
    assert rep.verdict(rep.paired_ratio_ci(_keyed(fast), _keyed(slow))) == "wins"
    assert rep.verdict(rep.paired_ratio_ci(_keyed(slow), _keyed(fast))) == "loses"
    mixed = [1.0 + i / 10 for i in range(30)]
    assert rep.verdict(rep.paired_ratio_ci(_keyed(mixed), _keyed(list(reversed(mixed))))
                       ) == "not decided"


def test_pairing_compares_each_request_with_itself(monkeypatch):
    """Request TTFTs spread 1..30 s (cold first turns, fast hits), the config 0.9x of the
    other on every request: paired, every resample's ratio is 0.9 (a win); keys only one
    config has are left out."""
    rep = _load("router_report", monkeypatch)
    base = [float(1 + (7 * i) % 30) for i in range(30)]
    a, b = _keyed([0.9 * v for v in base]), _keyed(base)
    b["extra"] = 100.0
    p50, lo, hi = rep.paired_ratio_ci(a, b)
    assert abs(p50 - 0.9) < 1e-12 and abs(lo - 0.9) < 1e-12 and abs(hi - 0.9) < 1e-12


def test_kv_variant_names_carry_router_options(monkeypatch):
    router = _load("router", monkeypatch)
    assert router.front_args("kv") == ("kv", [])
    assert router.front_args("round_robin") == ("round_robin", [])
    assert router.front_args("kv@evict-weight=0.5+overlap-weight=2") == (
        "kv", ["--evict-weight", "0.5", "--overlap-weight", "2"])
    assert router.front_args("kv@stick-gap=-1/pool") == ("kv", ["--stick-gap", "-1"])
