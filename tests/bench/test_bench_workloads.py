"""Synthetic workloads, dataset replays, and the conversation bookkeeping of drivers."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench.traces import TraceRequest
from deepinfer.bench.sessions import ConversationState, Session, Turn, to_text_messages, truncate_text
from deepinfer.bench.workloads import (
    agent_loop,
    document_qa,
    make_workload,
    multi_turn_chat,
    sharegpt_replay,
    sweagent_replay,
    taubench_replay,
    turns_from_messages,
    workload_from_trace,
)


def _play(session, reply="R"):
    """Messages a driver sends for each turn, with ``reply`` as every generated reply."""
    st = ConversationState(session)
    sent = []
    for t in session.turns:
        sent.append(st.request_messages(t))
        st.add_reply(t, f"{reply}{len(sent)}")
    return sent


def test_multi_turn_chat_shares_system_prompt_and_grows():
    wl = multi_turn_chat(num_users=3, turns=3, system_tokens=200, user_tokens=20, seed=1)
    assert wl.num_requests == 9
    assert wl == multi_turn_chat(num_users=3, turns=3, system_tokens=200, user_tokens=20, seed=1)
    assert wl != multi_turn_chat(num_users=3, turns=3, system_tokens=200, user_tokens=20, seed=2)
    systems = {s.turns[0].new_messages[0]["content"] for s in wl.sessions}
    assert len(systems) == 1 and len(next(iter(systems))) > 400
    sent = _play(wl.sessions[0])
    assert [m["role"] for m in sent[2]] == ["system", "user", "assistant", "user",
                                           "assistant", "user"]
    assert sent[1][:2] == sent[0] and sent[1][2] == {"role": "assistant", "content": "R1"}
    users = [m["content"] for s in wl.sessions for t in s.turns for m in t.new_messages
             if m["role"] == "user"]
    assert len(set(users)) == len(users)  # every turn new text
    assert wl.round_robin()[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]


def test_agent_loop_tool_specs_and_growing_outputs():
    wl = agent_loop(num_agents=2, steps=4, num_tools=5, tool_output_tokens=50,
                    tool_output_growth=40)
    s = wl.sessions[0]
    system = s.turns[0].new_messages[0]["content"]
    assert "Available tools" in system and '"parameters"' in system
    assert len(wl.meta["tools"]) == 5
    outs = [t.new_messages[0]["content"] for t in s.turns[1:]]
    assert all(len(b) > len(a) for a, b in zip(outs, outs[1:]))
    sent = _play(s)
    # the recorded tool call, not the generated text, goes into the history
    assert sent[1][2]["tool_calls"][0]["id"] == sent[1][3]["tool_call_id"]
    assert all(sent[k][: len(sent[k - 1])] == sent[k - 1] for k in range(1, len(sent)))
    text = agent_loop(num_agents=1, steps=2, tool_format="text")
    roles = [m["role"] for m in _play(text.sessions[0])[-1]]
    assert "tool" not in roles and roles.count("assistant") == 1


def test_document_qa_generated_shares_document_prefix(tmp_path):
    wl = document_qa(num_docs=2, questions_per_doc=3, doc_tokens=300, source="generated")
    assert wl.num_requests == 6 and not wl.sessions[0].accumulate
    sent = _play(wl.sessions[0])
    assert all(len(m) == 1 for m in sent)  # stand-alone requests
    docs = [m[0]["content"].rsplit("\n\n", 1)[0] for m in sent]
    assert len(set(docs)) == 1 and len({m[0]["content"] for m in sent}) == 3
    with pytest.raises(FileNotFoundError):
        document_qa(source="leval", traces_dir=tmp_path)


def test_document_qa_from_leval(traces_dir):
    if not list((traces_dir / "leval").glob("*.jsonl")):
        pytest.skip("no leval files")
    wl = document_qa(num_docs=2, questions_per_doc=2, doc_tokens=500, traces_dir=traces_dir)
    assert len(wl.sessions) == 2 and "#" in wl.sessions[0].session_id
    content = wl.sessions[0].turns[0].new_messages[0]["content"]
    assert len(content) < 500 * 4 + 2000


def test_turns_from_messages_and_budgets():
    msgs = [{"role": "assistant", "content": "lead"}, {"role": "system", "content": "S"},
            {"role": "user", "content": "u1" * 100}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "dangling"}]
    turns = turns_from_messages(msgs, prefix="x", max_message_tokens=10)
    assert len(turns) == 2
    assert [m["role"] for m in turns[0].new_messages] == ["system", "user"]
    assert len(turns[0].new_messages[1]["content"]) == 40  # 10 tokens * 4 chars
    assert turns[1].recorded_reply["content"] == "a2"
    sent = _play(Session("s", turns))
    assert sent[1][-2] == {"role": "assistant", "content": "a1"}  # recorded reply replayed
    assert len(turns_from_messages(msgs, prefix="x", max_turns=1)) == 1
    assert len(turns_from_messages(msgs, prefix="x", max_context_tokens=20)) == 1
    assert truncate_text("abcdefgh", 1) == "abcd"


def test_generated_replies_when_asked():
    t = Turn(new_messages=[{"role": "user", "content": "q"}],
             recorded_reply={"role": "assistant", "content": "recorded"})
    st = ConversationState(Session("s", [t]), use_recorded_replies=False)
    st.request_messages(t)
    st.add_reply(t, "generated")
    assert st.history[-1]["content"] == "generated"


def test_to_text_messages():
    out = to_text_messages([
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "name": "f", "content": "42"},
    ])
    assert out == [{"role": "assistant", "content": "Tool call: f({})"},
                   {"role": "user", "content": "Tool result (f):\n42"}]


def test_workload_from_trace_sessions_and_ideal():
    reqs = [TraceRequest(0.0, "a", [1, 2], 4, 8, 3, namespace="n", request_id="0"),
            TraceRequest(0.5, None, [9], 4, 4, 2, namespace="n", request_id="1"),
            TraceRequest(1.0, "a", [1, 2, 3], 4, 10, 5, namespace="n", request_id="2")]
    wl = workload_from_trace(reqs, vocab_size=1000, low=10)
    assert [s.session_id for s in wl.sessions] == ["a", "1"]
    a = wl.sessions[0]
    assert [t.arrival_s for t in a.turns] == [0.0, 1.0]
    assert [t.ideal_cached_tokens for t in a.turns] == [0, 8]
    assert [t.max_tokens for t in a.turns] == [3, 5]
    t0, t1 = (t.tokens() for t in a.turns)
    assert len(t1) == 10 and t1[:8] == t0 and min(t1) >= 10


def test_make_workload_unknown():
    with pytest.raises(ValueError):
        make_workload("nope")
    assert make_workload("chat", num_users=1, turns=1).num_requests == 1


# ------------------------------------------------------------------ real text datasets
def test_sharegpt_replay(real_file):
    wl = sharegpt_replay(real_file("sharegpt_v3_head.json"), max_conversations=3,
                         max_message_tokens=64, max_turns=3)
    assert len(wl.sessions) == 3
    s = wl.sessions[0]
    assert s.session_id == "QWJhYvA_0" and s.turns[0].new_messages[0]["role"] == "user"
    assert all(t.recorded_reply["role"] == "assistant" for t in s.turns)


def test_taubench_replay(real_file):
    wl = taubench_replay(real_file("taubench_gpt-4o-airline.json"), max_trajectories=2,
                         max_context_tokens=3000)
    assert [s.session_id for s in wl.sessions] == ["task0-trial0", "task1-trial0"]
    sent = _play(wl.sessions[0])
    roles = {m["role"] for m in sent[-1]}
    assert sent[0][0]["role"] == "system" and roles <= {"system", "user", "assistant", "tool"}
    calls = [m for m in sent[-1] if m.get("tool_calls")]
    if calls:  # tool calls are replayed with their ids, tool results follow them
        ids = {c["id"] for m in calls for c in m["tool_calls"]}
        assert all(m["tool_call_id"] in ids for m in sent[-1] if m["role"] == "tool")
    json.dumps(sent)


def test_sweagent_replay(traces_dir):
    d = traces_dir / "swe-agent-demos"
    if not d.is_dir():
        pytest.skip("swe-agent-demos not present")
    wl = sweagent_replay(d, max_trajectories=2, max_message_tokens=200)
    assert len(wl.sessions) == 2 and wl.num_requests > 2
    for s in wl.sessions:
        for m in _play(s)[-1]:
            assert set(m) == {"role", "content"} and m["role"] != "tool"
