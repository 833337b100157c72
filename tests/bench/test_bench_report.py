"""Metrics and the results folder: the numbers in summary.json are the records' numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer.bench.metrics import RequestRecord, cumulative_hit_rate, percentiles, summarize
from deepinfer.bench.report import write_report


def rec(i, arrival, first, finish, prompt, cached, out, tiers=None, ideal=None, error=None):
    return RequestRecord(request_id=f"r{i}", session_id="s", arrival_s=arrival,
                         first_token_s=first, finish_s=finish, prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=out,
                         cached_by_tier=tiers or {}, ideal_cached_tokens=ideal, error=error)


def _on():
    return [
        rec(0, 0.0, 0.10, 0.50, 100, 0, 5, {"device": 0}, ideal=0),
        rec(1, 0.2, 0.25, 0.65, 100, 80, 5, {"device": 60, "host": 20}, ideal=90),
        rec(2, 0.4, 0.46, 1.00, 200, 150, 9, {"device": 100, "disk": 50}, ideal=180),
        rec(3, 0.5, None, None, 50, 0, 0, error="boom"),
    ]


def _off():
    return [
        rec(0, 0.0, 0.10, 0.50, 100, 0, 5, ideal=0),
        rec(1, 0.2, 0.35, 0.75, 100, 0, 5, ideal=90),
        rec(2, 0.4, 0.60, 1.20, 200, 0, 9, ideal=180),
    ]


def test_record_derived_times():
    r = rec(0, 1.0, 1.5, 3.5, 10, 0, 5)
    assert (r.ttft_s, r.e2e_s, r.tpot_s) == (0.5, 2.5, 0.5)
    assert rec(0, 0, 0.1, 0.1, 1, 0, 1).tpot_s is None
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_percentiles():
    p = percentiles([1.0, 2.0, 3.0, 4.0, None])
    assert p["p50"] == 2.5 and p["mean"] == 2.5
    assert p["p90"] == pytest.approx(np.percentile([1, 2, 3, 4], 90))
    assert percentiles([])["p99"] is None


def test_summary_numbers():
    s = summarize(_on(), bytes_by_tier={"host": 4096})
    assert s["num_requests"] == 4 and s["num_errors"] == 1
    assert s["prompt_tokens"] == 400 and s["cached_tokens"] == 230
    assert s["prefill_tokens_computed"] == 170
    assert s["hit_rate"] == pytest.approx(230 / 400)
    assert s["hit_rate_by_tier"] == pytest.approx({"device": 160 / 400, "host": 20 / 400,
                                                   "disk": 50 / 400})
    assert s["ideal_hit_rate"] == pytest.approx(270 / 400)
    assert s["achieved_over_ideal"] == pytest.approx(230 / 270)
    assert s["ttft_s"]["p50"] == pytest.approx(0.06)
    assert s["e2e_s"]["p90"] == pytest.approx(np.percentile([0.5, 0.45, 0.6], 90))
    assert s["tpot_s"]["mean"] == pytest.approx(np.mean([0.1, 0.1, 0.54 / 8]))
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(19.0)
    assert s["throughput"]["total_tokens_per_s"] == pytest.approx(419.0)
    assert s["bytes_by_tier"] == {"host": 4096}
    assert cumulative_hit_rate(_on()).tolist() == pytest.approx([0.0, 0.4, 230 / 400])


def test_unreported_cache_is_not_zero_hit_rate():
    r = rec(0, 0.0, 0.1, 0.2, 100, 0, 2)
    r.cached_reported = False
    s = summarize([r])
    assert s["hit_rate"] is None and s["prefill_tokens_computed"] is None


def test_write_report(tmp_path):
    doc = write_report(tmp_path / "run1", {"cache-on": _on(), "cache-off": _off()},
                       meta={"workload": "unit"}, baseline="cache-off",
                       bytes_by_tier={"cache-on": {"host": 1 << 20}})
    d = tmp_path / "run1"
    for f in ("summary.json", "summary.md", "records.jsonl", "ttft_cdf.png", "hit_rate.png",
              "hit_rate_over_requests.png"):
        assert (d / f).stat().st_size > 0, f
    for f in ("ttft_cdf.png", "hit_rate.png", "hit_rate_over_requests.png"):
        assert (d / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((d / "summary.json").read_text())
    assert saved == json.loads(json.dumps(doc))
    on, off = saved["configs"]["cache-on"], saved["configs"]["cache-off"]
    assert on == json.loads(json.dumps(summarize(_on(), bytes_by_tier={"host": 1 << 20})))
    assert on["hit_rate"] == pytest.approx(0.575) and off["hit_rate"] == 0.0
    assert off["prefill_tokens_computed"] == 400
    sp = saved["speedup_vs_baseline"]["cache-on"]
    assert sp["ttft_p50"] == pytest.approx(off["ttft_s"]["p50"] / on["ttft_s"]["p50"])
    assert sp["prefill_tokens_saved"] == 230
    assert saved["meta"] == {"workload": "unit"}
    md = (d / "summary.md").read_text()
    assert "| metric | cache-on | cache-off |" in md
    assert "| **token hit rate** | 57.5% | 0.0% |" in md
    assert "hit rate: host" in md and "1.0 MiB" in md and "speedup vs cache-off" in md
    lines = (d / "records.jsonl").read_text().splitlines()
    assert len(lines) == 7 and json.loads(lines[0])["config"] == "cache-on"


def test_write_report_empty_config(tmp_path):
    doc = write_report(tmp_path / "r", {"x": []})
    assert doc["configs"]["x"]["num_requests"] == 0
    assert (tmp_path / "r" / "hit_rate.png").exists()
