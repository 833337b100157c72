"""The benchmark's workloads (``make_workload`` by name): synthetic chats, agent loops and
document QA, replays of recorded datasets (ShareGPT, tau-bench, SWE-agent), and block traces
as token prompts. Their shape (``Workload`` of ``Session``s of ``Turn``s) is ``sessions.py``'s.

Generators are seedable (``random.Random`` seeded with a string: sha512-based, stable across
processes) and take length budgets in approximate tokens, so a CPU run can be scaled to minutes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepinfer.bench.sessions import (Message, Session, Turn, Workload, apply_tool_format,
                                      message_tokens, truncate_text)
from deepinfer.bench.traces import TraceRequest, default_traces_dir

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "what will more if no out so said can who up time about into than them only other new "
    "some could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three system model cache memory token request server engine prefix layer page block "
    "tree branch leaf value query answer document question report market river city garden "
    "window engine harbor signal market planet forest battery circuit protocol network data"
).split()


def generate_text(rng: random.Random, n_tokens: int) -> str:
    """Pseudo-English of about ``n_tokens`` tokens (≈ 0.75 words per token)."""
    n_words = max(1, round(n_tokens * 0.75))
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    out, sent = [], []
    for w in words:
        sent.append(w)
        if len(sent) >= rng.randint(8, 16):
            out.append(" ".join(sent).capitalize() + ".")
            sent = []
    if sent:
        out.append(" ".join(sent).capitalize() + ".")
    return " ".join(out)


def _rng(seed: int, *parts: Any) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


# ---------------------------------------------------------------------------------- synthetic
def multi_turn_chat(
    num_users: int = 8,
    turns: int = 4,
    *,
    system_tokens: int = 1024,
    user_tokens: int = 64,
    max_tokens: int = 64,
    seed: int = 0,
) -> Workload:
    """N users sharing one long system prompt, T turns each, interleaved round-robin.

    Each turn's user message is new text; the previous assistant reply (whatever the engine
    produced) is part of the history, so turn k+1 reuses turn k's whole prompt and reply.
    """
    system = "You are a helpful assistant. " + generate_text(_rng(seed, "sys"), system_tokens)
    sessions = []
    for u in range(num_users):
        ts = []
        for k in range(turns):
            text = generate_text(_rng(seed, "user", u, k), user_tokens)
            new = [{"role": "user", "content": text}]
            if k == 0:
                new.insert(0, {"role": "system", "content": system})
            ts.append(Turn(new_messages=new, max_tokens=max_tokens, request_id=f"chat-u{u}-t{k}"))
        sessions.append(Session(session_id=f"chat-u{u}", turns=ts))
    return Workload(
        name="chat",
        sessions=sessions,
        meta={"num_users": num_users, "turns": turns, "system_tokens": system_tokens,
              "user_tokens": user_tokens, "seed": seed},
    )


_TOOL_NAMES = (
    "search_files", "read_file", "write_file", "run_tests", "grep", "list_directory",
    "http_get", "query_database", "send_email", "calculator", "get_weather", "create_ticket",
)


def tool_specs(num_tools: int, seed: int = 0) -> list[dict[str, Any]]:
    """OpenAI-style function tool specs (deterministic)."""
    specs = []
    for i in range(num_tools):
        rng = _rng(seed, "tool", i)
        name = _TOOL_NAMES[i % len(_TOOL_NAMES)] + ("" if i < len(_TOOL_NAMES) else f"_{i}")
        params = {
            f"arg{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                        "description": generate_text(rng, 12)}
            for j in range(rng.randint(1, 4))
        }
        specs.append({
            "type": "function",
            "function": {
                "name": name,
                "description": generate_text(rng, 40),
                "parameters": {"type": "object", "properties": params,
                               "required": sorted(params)[:1]},
            },
        })
    return specs


def agent_loop(
    num_agents: int = 4,
    steps: int = 6,
    *,
    num_tools: int = 8,
    task_tokens: int = 64,
    tool_output_tokens: int = 128,
    tool_output_growth: int = 64,
    max_tokens: int = 32,
    tool_format: str = "openai",
    seed: int = 0,
) -> Workload:
    """Agents sharing a system prompt with tool specs JSON; each step is an (scripted)
    assistant tool call followed by a tool output that grows by ``tool_output_growth`` tokens
    per step. The tool calls are recorded replies (a driver replaying them keeps the
    transcript well formed); ``tool_format="text"`` renders tools as plain messages.
    """
    specs = tool_specs(num_tools, seed)
    system = (
        "You are an autonomous agent. Call exactly one tool per step. Available tools:\n"
        + json.dumps(specs, indent=1)
    )
    sessions = []
    for a in range(num_agents):
        rng = _rng(seed, "agent", a)
        task = "Task: " + generate_text(rng, task_tokens)
        ts: list[Turn] = []
        pending: list[Message] = [{"role": "system", "content": system},
                                  {"role": "user", "content": task}]
        for k in range(steps):
            fn = specs[rng.randrange(len(specs))]["function"]
            args = {p: generate_text(rng, 4) for p in fn["parameters"]["properties"]}
            call_id = f"call_{a}_{k}"
            call = {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": fn["name"], "arguments": json.dumps(args)}}]}
            ts.append(Turn(new_messages=pending, max_tokens=max_tokens, recorded_reply=call,
                           request_id=f"agent-a{a}-s{k}"))
            out_tokens = tool_output_tokens + k * tool_output_growth
            pending = [{"role": "tool", "tool_call_id": call_id, "name": fn["name"],
                        "content": generate_text(rng, out_tokens)}]
        sessions.append(Session(session_id=f"agent-a{a}", turns=ts))
    wl = Workload(name="agent", sessions=sessions,
                  meta={"num_agents": num_agents, "steps": steps, "num_tools": num_tools,
                        "tool_format": tool_format, "seed": seed, "tools": specs})
    return apply_tool_format(wl, tool_format)


def document_qa(
    num_docs: int = 4,
    questions_per_doc: int = 4,
    *,
    doc_tokens: int = 2048,
    source: str = "auto",
    traces_dir: str | Path | None = None,
    max_tokens: int = 32,
    seed: int = 0,
) -> Workload:
    """Several questions per long document; each question is its own request with the
    document first (questions about one document share its prefix). Documents come from
    ``leval/*.jsonl`` (``source="leval"``, or "auto" when present) or are generated.
    Questions of different documents are interleaved round-robin.
    """
    docs: list[tuple[str, str, list[str]]] = []
    if source in ("auto", "leval"):
        base = Path(traces_dir) if traces_dir else default_traces_dir()
        files = sorted((base / "leval").glob("*.jsonl")) if base else []
        if not files and source == "leval":
            raise FileNotFoundError("no leval/*.jsonl under the traces folder")
        for f in files:
            with open(f) as fh:
                for i, line in enumerate(fh):
                    r = json.loads(line)
                    qs = [q for q in r.get("instructions", []) if q]
                    if len(qs) >= min(2, questions_per_doc):
                        docs.append((f"{f.stem}#{i}", r["input"], qs))
                    break  # one document per task file: variety
            if len(docs) >= num_docs:
                break
    while len(docs) < num_docs:
        k = len(docs)
        rng = _rng(seed, "doc", k)
        qs = [f"Question {q + 1}: " + generate_text(rng, 24) + "?"
              for q in range(questions_per_doc)]
        docs.append((f"generated#{k}", generate_text(rng, doc_tokens), qs))
    sessions = []
    for d, (did, text, qs) in enumerate(docs[:num_docs]):
        doc = truncate_text(text, doc_tokens)
        ts = []
        for q, question in enumerate(qs[:questions_per_doc]):
            content = f"Read the document and answer the question.\n\n{doc}\n\n{question}"
            ts.append(Turn(new_messages=[{"role": "user", "content": content}],
                           max_tokens=max_tokens, request_id=f"docqa-d{d}-q{q}"))
        sessions.append(Session(session_id=did, turns=ts, accumulate=False))
    return Workload(name="docqa", sessions=sessions,
                    meta={"num_docs": num_docs, "questions_per_doc": questions_per_doc,
                          "doc_tokens": doc_tokens, "seed": seed})


# ---------------------------------------------------------------------------------- replays
def turns_from_messages(
    messages: Sequence[Message],
    *,
    prefix: str,
    max_turns: int | None = None,
    max_message_tokens: int | None = None,
    max_context_tokens: int | None = None,
    max_reply_tokens: int = 256,
) -> list[Turn]:
    """One turn per assistant message: its input is every earlier message (the turn's
    ``new_messages`` are those since the previous assistant message), its recorded reply is
    the assistant message. Leading assistant messages and a trailing non-reply are dropped.
    """
    turns: list[Turn] = []
    pending: list[Message] = []
    context = 0
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), str):
            m["content"] = truncate_text(m["content"], max_message_tokens)
        if m.get("role") != "assistant":
            pending.append(m)
            continue
        if not pending and not turns:
            continue
        added = sum(message_tokens(x) for x in pending)
        if turns and max_context_tokens is not None and context + added > max_context_tokens:
            break
        reply_tokens = max(1, min(max_reply_tokens, message_tokens(m) - 4))
        turns.append(Turn(new_messages=pending, max_tokens=reply_tokens, recorded_reply=m,
                          request_id=f"{prefix}-t{len(turns)}"))
        context += added + message_tokens(m)
        pending = []
        if max_turns is not None and len(turns) >= max_turns:
            break
    return turns


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "assistant": "assistant",
                   "system": "system"}


def sharegpt_replay(
    path: str | Path | None = None,
    *,
    max_conversations: int | None = 32,
    min_turns: int = 1,
    **turn_kw: Any,
) -> Workload:
    """ShareGPT conversations (``[{id, conversations:[{from, value}]}]``) with their turns."""
    path = Path(path) if path else _trace_file("sharegpt_v3_head.json")
    data = json.loads(path.read_text())
    sessions = []
    for conv in data:
        msgs = [{"role": _SHAREGPT_ROLES.get(m.get("from"), "user"), "content": m.get("value", "")}
                for m in conv.get("conversations", [])]
        turns = turns_from_messages(msgs, prefix=f"sharegpt-{conv.get('id')}", **turn_kw)
        if len(turns) >= min_turns:
            sessions.append(Session(session_id=str(conv.get("id")), turns=turns))
        if max_conversations is not None and len(sessions) >= max_conversations:
            break
    return Workload(name="sharegpt", sessions=sessions, meta={"path": str(path)})


def _clean_openai(m: Message) -> Message:
    keep = {"role", "content", "tool_calls", "tool_call_id", "name"}
    out = {k: v for k, v in m.items() if k in keep and v is not None}
    out.setdefault("content", None if out.get("tool_calls") else "")
    return out


def taubench_replay(
    path: str | Path | None = None,
    *,
    max_trajectories: int | None = 16,
    tool_format: str = "openai",
    **turn_kw: Any,
) -> Workload:
    """tau-bench trajectories (``traj`` = OpenAI messages with tool calls), real turns."""
    path = Path(path) if path else _trace_file("taubench_gpt-4o-airline.json")
    data = json.loads(path.read_text())
    sessions = []
    for t in data[:max_trajectories]:
        sid = f"task{t.get('task_id')}-trial{t.get('trial')}"
        msgs = [_clean_openai(m) for m in t.get("traj", [])]
        sessions.append(Session(session_id=sid,
                                turns=turns_from_messages(msgs, prefix=f"tau-{sid}", **turn_kw)))
    return apply_tool_format(Workload(name="taubench", sessions=sessions,
                                       meta={"path": str(path), "tool_format": tool_format}),
                              tool_format)


def sweagent_replay(
    path: str | Path | None = None,
    *,
    max_trajectories: int | None = None,
    **turn_kw: Any,
) -> Workload:
    """SWE-agent ``.traj`` files (``history`` = messages sent to the model); observations
    sent as tool messages become user messages (their tool-call ids are not replayable)."""
    base = Path(path) if path else _trace_file("swe-agent-demos")
    files = sorted(base.glob("*.traj")) if base.is_dir() else [base]
    sessions = []
    for f in files[:max_trajectories]:
        hist = json.loads(f.read_text()).get("history", [])
        msgs = []
        for m in hist:
            role = m.get("role", "user")
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content)
            msgs.append({"role": "user" if role == "tool" else role, "content": content})
        sessions.append(Session(session_id=f.stem,
                                turns=turns_from_messages(msgs, prefix=f"swe-{f.stem}", **turn_kw)))
    return Workload(name="sweagent", sessions=sessions, meta={"path": str(base)})


def _trace_file(name: str) -> Path:
    base = default_traces_dir()
    if base is None or not (base / name).exists():
        raise FileNotFoundError(f"{name} not found (set DEEPINFER_TRACES)")
    return base / name


# ---------------------------------------------------------------------------------- traces
def workload_from_trace(
    requests: Sequence[TraceRequest],
    *,
    vocab_size: int,
    low: int = 0,
    with_ideal: bool = True,
    name: str = "trace",
) -> Workload:
    """Block trace -> token-prompt workload: one stand-alone session per trace session
    (turns in arrival order, each sent after the previous finished and not before its
    arrival), one single-turn session per request without a session. Prompts are generated
    lazily (``Turn.tokens()``) from ``tokens.TokenBlocks``; ``ideal_cached_tokens`` is set.
    """
    from deepinfer.bench.ideal import IdealIndex
    from deepinfer.bench.tokens import TokenBlocks

    blocks = TokenBlocks(vocab_size, low=low)
    idx = IdealIndex() if with_ideal else None
    by_session: dict[str, Session] = {}
    sessions: list[Session] = []
    for i, r in enumerate(requests):
        ideal = (idx.lookup_insert(r.namespace, r.block_ids, r.block_size, r.input_length)
                 if idx is not None else None)
        turn = Turn(max_tokens=max(1, r.output_length), arrival_s=r.arrival_s,
                    request_id=r.request_id or f"{name}-{i}",
                    prompt_tokens=(lambda r=r: blocks.request_tokens(r)),
                    ideal_cached_tokens=ideal)
        if r.session_id is None:
            sessions.append(Session(session_id=turn.request_id, turns=[turn], accumulate=False))
            continue
        s = by_session.get(r.session_id)
        if s is None:
            s = by_session[r.session_id] = Session(session_id=r.session_id, turns=[],
                                                   accumulate=False)
            sessions.append(s)
        s.turns.append(turn)
    return Workload(name=name, sessions=sessions,
                    meta={"requests": len(requests), "vocab_size": vocab_size, "low": low})


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": multi_turn_chat,
    "agent": agent_loop,
    "docqa": document_qa,
    "sharegpt": sharegpt_replay,
    "taubench": taubench_replay,
    "sweagent": sweagent_replay,
}


def make_workload(name: str, **kwargs: Any) -> Workload:
    try:
        return WORKLOADS[name](**kwargs)
    except KeyError:
        if name in WORKLOADS:
            raise
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None
