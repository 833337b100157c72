"""Engine mode: configs, session order, records, the transformers baseline, the CLI."""

from __future__ import annotations

import json

from deepinfer.bench.backends import EngineBackend
from deepinfer.bench.driver import DriveOptions, drive
from deepinfer.bench.engine_bench import (CONFIG_PRESETS, bytes_by_tier, resolve_configs, run_engine_bench,
                                          write_engine_report)
from deepinfer.bench.traces import TraceRequest
from deepinfer.bench.workloads import multi_turn_chat, workload_from_trace

ENGINE = {"page_size": 4, "num_pages": 256, "max_num_batched_tokens": 64}
QUIET = DriveOptions(idle="skip", progress=False)


def trace(n_sessions=2, turns=3):
    """Sessions sharing a 16-token system block pair; each turn extends the previous one."""
    out = []
    for k in range(turns):
        for s in range(n_sessions):
            blocks = [1, 2] + [100 * s + j for j in range(k + 1)]
            out.append(TraceRequest(arrival_s=0.05 * len(out), session_id=f"s{s}",
                                    block_ids=blocks, block_size=8,
                                    input_length=8 * len(blocks) - 3, output_length=3,
                                    namespace="drv", request_id=f"s{s}-t{k}", turn=k))
    return out


def test_resolve_configs_skips_unknown_fields():
    run, skipped = resolve_configs(["off", "l1", "all", "nope", "mine"],
                                   {"mine": {"page_size": 8, "no_such_field": 1}},
                                   run_dir="/tmp/run")
    assert run["off"] == {"enable_prefix_cache": False}
    assert run["l1"]["host_cache_gb"] == 0 and run["l1"]["enable_disk_cache"] is False
    assert run["all"]["disk_cache_dir"] == "/tmp/run/l3-cache"
    assert "no_such_field" in skipped["mine"] and "skipped" in skipped["mine"]
    assert "unknown config" in skipped["nope"]
    assert set(CONFIG_PRESETS) == {"off", "l1", "all"}


def test_bytes_by_tier_from_engine_stats():
    stats = {"prefix_cache_hits": 3, "cache_bytes_read_by_tier": {"host": 10, "disk": 20},
             "cache_bytes_written_by_tier": {"host": 5, "disk": 7}, "cache_disk_bytes": 99}
    assert bytes_by_tier(stats) == {"host read": 10, "disk read": 20, "host written": 5,
                                    "disk written": 7}  # cache_disk_bytes: held, not moved
    assert bytes_by_tier({"prefix_cache_hits": 1}) is None


def test_drive_trace_sessions_in_order(tiny_llama):
    backend = EngineBackend({"model": str(tiny_llama), **ENGINE, **CONFIG_PRESETS["l1"]})
    try:
        tr = trace()
        wl = workload_from_trace(tr, vocab_size=backend.vocab_size, low=3)
        res = drive(backend, wl, QUIET, page_size=4)
    finally:
        backend.close()
    recs = {r.request_id: r for r in res.records}
    assert len(recs) == 6 and all(r.ok for r in recs.values())
    for t in tr:
        r = recs[t.request_id]
        assert r.arrival_s >= t.arrival_s - 1e-6  # not before its arrival
        assert r.prompt_tokens == t.input_length and r.completion_tokens == 3
        assert 0 <= r.ttft_s <= r.e2e_s
        assert r.cached_by_tier == {"device": r.cached_tokens}
        if t.turn:  # turn k+1 only after turn k's reply
            prev = recs[f"{t.session_id}-t{t.turn - 1}"]
            assert r.arrival_s >= prev.finish_s
            assert r.cached_tokens >= 16  # at least the shared system blocks
        assert r.ideal_cached_tokens is not None
    assert res.stats["prefix_cache_hits"] == sum(r.cached_tokens for r in recs.values())


def test_engine_columns_and_transformers_baseline(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from deepinfer.chat import render_chat

    wl = multi_turn_chat(num_users=2, turns=2, system_tokens=24, user_tokens=8, max_tokens=4)
    logs = []
    configs, skipped = resolve_configs(["l1", "mine"], {"mine": {"bogus": 1}})
    run = run_engine_bench(wl, configs, engine_args={"model": str(tiny_llama), **ENGINE},
                           baseline="transformers", skipped=skipped, opts=QUIET,
                           log=logs.append)
    assert list(run.results) == ["l1", "transformers"]
    assert any("mine" in m for m in logs)
    by = {n: {r.request_id: r for r in res.records} for n, res in run.results.items()}
    # same transcripts in every column (greedy: same replies), so the same prompts
    for rid in by["l1"]:
        assert by["l1"][rid].prompt_tokens == by["transformers"][rid].prompt_tokens
        assert by["transformers"][rid].completion_tokens == 4
        assert by["transformers"][rid].cached_tokens == 0
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    first = wl.sessions[0].turns[0].new_messages
    assert by["l1"]["chat-u0-t0"].prompt_tokens == len(render_chat(tok, first))
    assert by["l1"]["chat-u1-t0"].cached_tokens > 0  # the shared system prompt
    assert by["l1"]["chat-u0-t1"].cached_tokens > by["l1"]["chat-u1-t0"].cached_tokens
    doc = write_engine_report(tmp_path, run, meta={"workload": "chat"},
                              baseline_column="transformers")
    assert list(doc["configs"]) == ["l1", "transformers"]
    assert doc["configs"]["transformers"]["hit_rate"] == 0.0
    assert doc["configs"]["l1"]["hit_rate"] > 0
    assert doc["meta"]["skipped mine"].startswith("EngineConfig has no field(s) bogus")
    saved = doc["speedup_vs_baseline"]["l1"]["prefill_tokens_saved"]
    assert saved == doc["configs"]["l1"]["cached_tokens"] > 0
    md = (tmp_path / "summary.md").read_text()
    assert "| metric | l1 | transformers |" in md


def test_cli_engine_trace(tiny_llama, tmp_path, capsys):
    from deepinfer.bench.cli import main

    path = tmp_path / "t_blk8.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"timestamp": 1000 * r.arrival_s, "input_length": r.input_length,
                                 "output_length": r.output_length, "hash_ids": r.block_ids,
                                 "session_id": r.session_id, "turn": r.turn}) + "\n"
                     for r in trace(turns=2))
    rc = main(["engine", "--model", str(tiny_llama), "--workload", "trace", "--trace", str(path),
               "--configs", "l1", "--rounds", "2", "--baseline", "none",
               "--engine-args", json.dumps(ENGINE), "--idle", "skip", "--token-low", "3",
               "--out", str(tmp_path / "res"), "--run", "r", "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "res" / "r" / "summary.json").read_text())
    assert list(doc["configs"]) == ["l1"]
    s = doc["configs"]["l1"]
    assert s["num_requests"] == 4 and s["num_errors"] == 0
    assert 0.3 < s["hit_rate"] <= s["ideal_hit_rate"]  # trace ideal: block granularity
    assert len(doc["meta"]["durations of the rounds l1 (s)"]) == 2
    assert "token hit rate" in capsys.readouterr().out
