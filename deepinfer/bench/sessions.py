"""Benchmark workloads as sessions of chat turns (or token prompts for block traces).

A ``Workload`` is a list of ``Session``s; a session is an ordered list of ``Turn``s. A turn
adds ``new_messages`` to the session's history and asks for a reply; the driver (engine bench
or ``client.py``) sends turn k+1 only after turn k's reply arrived and appends the reply to
the history: the text the engine produced, or the dataset's ``recorded_reply`` when there is
one and the driver replays recorded replies (agent trajectories need their real tool calls).
``ConversationState`` implements exactly that bookkeeping for every driver.

Stand-alone sessions (``accumulate=False``: document QA, block traces) send each turn's
messages (or ``prompt_tokens``) alone; their sessions only order the turns. Lengths are in
approximate tokens (``CHARS_PER_TOKEN`` characters per token, or a tokenizer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4

Message = dict[str, Any]


@dataclass
class Turn:
    new_messages: list[Message] = field(default_factory=list)
    max_tokens: int = 64
    recorded_reply: Message | None = None
    arrival_s: float | None = None  # not sent before this many seconds after the run start
    think_time_s: float = 0.0  # pause after the previous turn's reply
    request_id: str = ""
    prompt_tokens: list[int] | Callable[[], list[int]] | None = None  # token prompt (traces)
    ideal_cached_tokens: int | None = None

    def tokens(self) -> list[int] | None:
        p = self.prompt_tokens
        return p() if callable(p) else p


@dataclass
class Session:
    session_id: str
    turns: list[Turn]
    accumulate: bool = True


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def round_robin(self) -> list[tuple[int, int]]:
        """(session index, turn index) in round-robin order: turn 0 of every session, then 1..."""
        return interleave_round_robin(self.sessions)


def interleave_round_robin(sessions: Sequence[Session]) -> list[tuple[int, int]]:
    order = []
    for k in range(max((len(s.turns) for s in sessions), default=0)):
        for i, s in enumerate(sessions):
            if k < len(s.turns):
                order.append((i, k))
    return order


class ConversationState:
    """History of one session as a driver sends its turns."""

    def __init__(self, session: Session, use_recorded_replies: bool = True) -> None:
        self.session = session
        self.use_recorded_replies = use_recorded_replies
        self.history: list[Message] = []

    def request_messages(self, turn: Turn) -> list[Message]:
        """Messages to send for ``turn`` (call once per turn, in order)."""
        if not self.session.accumulate:
            return [dict(m) for m in turn.new_messages]
        self.history.extend(dict(m) for m in turn.new_messages)
        return [dict(m) for m in self.history]

    def add_reply(self, turn: Turn, text: str) -> None:
        if not self.session.accumulate:
            return
        if self.use_recorded_replies and turn.recorded_reply is not None:
            self.history.append(dict(turn.recorded_reply))
        else:
            self.history.append({"role": "assistant", "content": text})



def approx_tokens(text: str | None) -> int:
    return math.ceil(len(text or "") / CHARS_PER_TOKEN)


def truncate_text(text: str, max_tokens: int | None, tokenizer: Any = None) -> str:
    """First ``max_tokens`` tokens of ``text`` (by tokenizer, else by characters)."""
    if max_tokens is None or not text:
        return text
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    return text[: max_tokens * CHARS_PER_TOKEN]


def message_tokens(m: Message) -> int:
    n = approx_tokens(m.get("content") if isinstance(m.get("content"), str) else "")
    if m.get("tool_calls"):
        n += approx_tokens(json.dumps(m["tool_calls"]))
    return n + 4


def to_text_messages(messages: Iterable[Message]) -> list[Message]:
    """Tool calls and tool results rendered as plain text (for chat templates without tools)."""
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", c) if isinstance(c, dict) else {"name": str(c)}
                calls.append(f"{fn.get('name')}({fn.get('arguments', '')})")
            content = (content + "\n" if content else "") + "Tool call: " + "; ".join(calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            name = m.get("name")
            head = f"Tool result ({name}):" if name else "Tool result:"
            out.append({"role": "user", "content": f"{head}\n{content}"})
        else:
            out.append({"role": role, "content": content})
    return out


def apply_tool_format(wl: Workload, tool_format: str) -> Workload:
    """``wl`` with its tool calls and results as OpenAI messages (as is) or as plain text (in place)."""
    if tool_format == "openai":
        return wl
    if tool_format != "text":
        raise ValueError("tool_format must be 'openai' or 'text'")
    for s in wl.sessions:
        for t in s.turns:
            t.new_messages = to_text_messages(t.new_messages)
            if t.recorded_reply is not None:
                t.recorded_reply = to_text_messages([t.recorded_reply])[0]
    return wl
