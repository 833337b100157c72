"""Trace loaders (hand-written files of every format, real files) and trace scaling."""

from __future__ import annotations

import json
import math

import pytest

from deepinfer.bench.ideal import ideal_hits
from deepinfer.bench.traces import (
    TraceRequest,
    detect_format,
    load_kvtester_dir,
    load_kvtester_file,
    load_mooncake,
    load_trace,
    scale_trace,
    trace_stats,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_jsonl(tmp_path):
    p = _write_jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
        {"timestamp": 1500, "input_length": 512, "output_length": 1, "hash_ids": [3]},
    ])
    reqs = load_mooncake(p)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 1.5]
    assert all(r.block_size == 512 and r.session_id is None and r.namespace == "mc" for r in reqs)
    assert reqs[1].block_ids == [0, 2] and reqs[1].input_length == 600
    assert reqs[1].output_length == 7
    assert reqs[0].block_token_counts() == [512, 488]
    assert len({r.request_id for r in reqs}) == 3
    assert detect_format(p) == "mooncake"
    assert load_trace(p, max_requests=2)[-1].input_length == 600
    # 512 of request 1 hit (block 0); the 488-token partial block 1 is not shared
    assert ideal_hits(reqs).hit_tokens.tolist() == [0, 512, 0]


def test_derived_jsonl_sessions_and_block_size(tmp_path):
    p = _write_jsonl(tmp_path / "derived_x_blk64.jsonl", [
        {"timestamp": 0, "input_length": 70, "output_length": 3, "hash_ids": [0, 1],
         "session_id": "a", "turn": 1},
        {"timestamp": 100, "input_length": 20, "output_length": 3, "hash_ids": [2],
         "session_id": "b", "turn": 1},
        {"timestamp": 200, "input_length": 140, "output_length": 3, "hash_ids": [0, 3, 4],
         "session_id": "a", "turn": 2},
    ])
    reqs = load_trace(p)
    assert [r.block_size for r in reqs] == [64, 64, 64]
    assert [(r.session_id, r.turn) for r in reqs] == [("a", 1), ("b", 1), ("a", 2)]
    assert reqs[0].block_token_counts() == [64, 6]  # partial last block
    assert reqs[2].arrival_s == pytest.approx(0.2)
    assert trace_stats(reqs).num_sessions == 2


def _kvt(path, ident, requests, block_size=64):
    d = {"id": ident, "models": ["m"], "block_size": block_size, "hash_id_scope": "local",
         "tool_tokens": 10, "system_tokens": 20, "requests": requests}
    path.write_text(json.dumps(d))
    return path


def _kr(t, n_in, ids, out=5, **kw):
    return {"t": t, "type": "n", "model": "m", "in": n_in, "out": out, "hash_ids": ids, **kw}


def test_kvtester_flattens_subagents_in_time_order(tmp_path):
    p = _kvt(tmp_path / "trace_0001.json", "trace_0001", [
        _kr(0.0, 130, [1, 2]),
        {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "requests": [
            _kr(0.0, 64, [100], out=1),
            _kr(10.0, 128, [100, 101], out=2),
        ]},
        _kr(12.0, 200, [1, 2, 3], type="s"),
    ])
    reqs = load_kvtester_file(p)
    assert [r.arrival_s for r in reqs] == [0.0, 5.0, 12.0, 15.0]
    assert [r.session_id for r in reqs] == ["trace_0001", "trace_0001/agent_001",
                                           "trace_0001", "trace_0001/agent_001"]
    assert [r.turn for r in reqs] == [1, 1, 2, 2]
    assert [r.input_length for r in reqs] == [130, 64, 200, 128]
    assert all(r.namespace == "trace_0001" and r.block_size == 64 for r in reqs)
    # 130 tokens, 2 hashed blocks: 2 unhashed tail tokens
    assert reqs[0].hashed_tokens == 128
    assert detect_format(p) == "kvtester"


def test_kvtester_local_scope_never_collides_across_files(tmp_path):
    _kvt(tmp_path / "trace_0001.json", "trace_0001", [_kr(0.0, 128, [1, 2])])
    _kvt(tmp_path / "trace_0002.json", "trace_0002", [_kr(0.0, 128, [1, 2]),
                                                      _kr(3.0, 128, [1, 2])])
    reqs = load_kvtester_dir(tmp_path)
    assert [r.namespace for r in reqs] == ["trace_0001", "trace_0002", "trace_0002"]
    assert ideal_hits(reqs).hit_tokens.tolist() == [0, 0, 128]
    staggered = load_kvtester_dir(tmp_path, session_stagger_s=100.0)
    assert [r.arrival_s for r in staggered] == [0.0, 100.0, 103.0]
    assert load_trace(tmp_path)[0].namespace == "trace_0001"


def _r(ids, n, bs=64, out=100, t=10.0):
    return TraceRequest(arrival_s=t, session_id="s", block_ids=ids, block_size=bs,
                        input_length=n, output_length=out, namespace="n", request_id="r")


def test_scale_keeps_block_structure():
    reqs = [_r([1, 2, 3], 150), _r([1, 2, 3], 150), _r([1, 2], 140), _r([1, 2, 4], 192)]
    small = scale_trace(reqs, token_scale=1 / 8)
    assert [r.block_size for r in small] == [8] * 4
    # 150 = 2 full blocks + 22: 16 + ceil(22/8) = 19;  140 = 2 full + unhashed 12 -> 16 + 2
    assert [r.input_length for r in small] == [19, 19, 18, 24]
    assert [r.output_length for r in small] == [12] * 4
    assert small[0].block_ids == [1, 2, 3] and small[2].block_ids == [1, 2]
    big, sm = ideal_hits(reqs), ideal_hits(small)
    assert big.hit_tokens.tolist() == [0, 150, 128, 128]
    assert sm.hit_tokens.tolist() == [0, 19, 16, 16]
    assert reqs[0].input_length == 150  # inputs untouched


def test_scale_caps_and_time():
    reqs = [_r([1, 2, 3], 150, t=0.0), _r([1, 2, 3, 4], 256, t=10.0), _r([5], 30, t=20.0)]
    out = scale_trace(reqs, max_input_tokens=100, max_output_tokens=7, time_compression=4.0)
    assert [r.input_length for r in out] == [100, 100, 30]
    assert [r.block_ids for r in out] == [[1, 2], [1, 2], [5]]
    assert [r.output_length for r in out] == [7, 7, 7]
    assert [r.arrival_s for r in out] == [0.0, 2.5, 5.0]
    assert [r.arrival_s for r in scale_trace(reqs, time_compression=math.inf)] == [0.0] * 3
    assert len(scale_trace(reqs, max_requests=2)) == 2
    assert len(scale_trace(reqs, max_duration_s=10.0)) == 2
    with pytest.raises(ValueError):
        scale_trace(reqs, token_scale=0)


# ------------------------------------------------------------------ real files (smoke)
@pytest.mark.parametrize("name,bs", [
    ("mooncake_conversation_trace.jsonl", 512),
    ("mooncake_synthetic_trace.jsonl", 512),
    ("derived_sharegpt_blk64.jsonl", 64),
    ("derived_taubench_airline_blk64.jsonl", 64),
    ("derived_sweagent_demos_blk64.jsonl", 64),
    ("derived_leval_docqa_blk64.jsonl", 64),
])
def test_real_jsonl_head(real_file, name, bs):
    reqs = load_trace(real_file(name), max_requests=20)
    assert len(reqs) == 20
    for r in reqs:
        assert r.block_size == bs
        assert len(r.block_ids) == math.ceil(r.input_length / bs)
        assert r.output_length >= 0 and r.arrival_s >= 0
    assert (reqs[0].session_id is None) == name.startswith("mooncake")
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s)


def test_real_kvtester_head(traces_dir):
    d = traces_dir / "kv-cache-tester"
    if not d.is_dir():
        pytest.skip("kv-cache-tester not present")
    reqs = load_kvtester_dir(d, max_files=2)
    assert reqs and len({r.namespace for r in reqs}) == 2
    for r in reqs:
        assert r.block_size == 64
        assert len(r.block_ids) == r.input_length // 64  # full blocks only
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_real_kvtester_subagents(real_file):
    reqs = load_kvtester_file(real_file("kv-cache-tester/trace_0014.json"))
    subs = [r for r in reqs if "/" in (r.session_id or "")]
    assert subs, "trace_0014 has a sub-agent"
    assert {r.namespace for r in reqs} == {"trace_0014"}
