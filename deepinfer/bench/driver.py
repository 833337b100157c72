"""Drive a workload through a backend (``backends.py``): sessions interleaved, turn by turn,
one ``RequestRecord`` per request.

Scheduling is the same as client mode's (``client.py``): sessions run interleaved, each one
turn at a time (turn k+1 is added only after turn k's reply, plus its think time, and never
before its ``arrival_s``). The driver adds a request to the engine when its time comes and
steps the engine in a loop; when the engine is idle and the next turn is not due, it sleeps
(``idle="sleep"``, arrival times honoured in real time) or moves its clock forward
(``idle="skip"``: gaps vanish, latencies are unchanged since they are measured from the add).
``max_in_flight`` bounds the requests in the engine at once (default: no bound; the engine's
``max_num_seqs`` batches them).

Per request (``metrics.RequestRecord``): TTFT from ``add_request`` to the first token and
the finish time, both from the engine's own clock (``Request.arrival_time``,
``first_token_time``, ``finish_time``); cached tokens and ``Request.cached_tokens_by_tier``;
completion tokens. Per config: ``engine.stats()`` (kept whole in the report's meta; numbers
whose name mentions bytes become ``bytes_by_tier``); the stats include one 16-token warm-up
request run before the clock starts (``DriveOptions.warmup``).

Chat turns are rendered with ``deepinfer.chat.render_chat`` on the whole message list each
turn (``LLM.chat`` semantics: the prompt is the template over the history, the reply text is
appended to the history). Tool calls become plain text (``workloads.to_text_messages``) when
the model's chat template has no tool support (``tool_format="auto"``). Token-prompt turns
(block traces) are sent as token ids. ``ideal_cached_tokens`` comes from the trace where it
has one, else from an infinite cache at the engine's page size over everything earlier
requests held (prompt and reply), less the last token (always computed).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.bench.backends import Backend, Finished
from deepinfer.bench.metrics import RequestRecord
from deepinfer.bench.sessions import ConversationState, Turn, Workload, to_text_messages


@dataclass
class DriveOptions:
    max_in_flight: int | None = None
    use_recorded_replies: bool = True
    tool_format: str = "auto"  # auto | openai | text
    idle: str = "sleep"  # sleep | skip
    max_requests: int | None = None
    max_duration_s: float | None = None  # no request added after this (run clock)
    progress: bool = True
    label: str = ""
    warmup: bool = True  # one short request first, not recorded (one-time costs off the clock)


@dataclass
class DriveResult:
    records: list[RequestRecord]
    duration_s: float | None  # None: first arrival -> last finish of the records
    stats: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)


def _template_has_tools(tokenizer: Any) -> bool:
    t = getattr(tokenizer, "chat_template", None) or ""
    return "tool" in t if isinstance(t, str) else True


class _IdealTracker:
    """Infinite cache at the engine's page size over what earlier requests held."""

    def __init__(self, page_size: int) -> None:
        from deepinfer.bench.ideal import IdealIndex

        self.ps = page_size
        self.idx = IdealIndex()

    def lookup(self, prompt: list[int]) -> int:
        from deepinfer.bench.ideal import token_block_ids

        hit = self.idx.lookup_insert("", token_block_ids(prompt, self.ps), self.ps, len(prompt))
        return min(hit // self.ps, (len(prompt) - 1) // self.ps) * self.ps

    def add(self, tokens: list[int]) -> None:
        from deepinfer.bench.ideal import token_block_ids

        self.idx.lookup_insert("", token_block_ids(tokens, self.ps), self.ps, len(tokens))


@dataclass(order=True)
class _Due:
    ready_at: float
    order: int
    session: int = field(compare=False)


class _Drive:
    """One ``drive`` call's state: the due-turn heap, the run clock, requests in flight."""

    def __init__(self, backend: Backend, workload: Workload, opts: DriveOptions,
                 page_size: int | None) -> None:
        self.backend = backend
        self.opts = opts
        self.sessions = workload.sessions
        self.states = [ConversationState(s, use_recorded_replies=opts.use_recorded_replies)
                       for s in self.sessions]
        self.next_turn = [0] * len(self.sessions)
        self.ideal = _IdealTracker(page_size) if page_size else None
        self.text_tools = (opts.tool_format == "text"
                           or (opts.tool_format == "auto" and not _template_has_tools(backend.tokenizer)))
        self.heap: list[_Due] = []
        self.order = 0
        self.t0 = 0.0  # set when the clock starts, after the warm-up
        self.skipped_s = 0.0
        self.records: list[RequestRecord] = []
        self.inflight: dict[str, tuple[int, Turn, RequestRecord, list[int]]] = {}
        self.issued = 0
        self.notes: dict[str, Any] = {"template_fallbacks": 0, "text_tools": self.text_tools}

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.skipped_s

    def schedule(self, i: int, after: float) -> None:
        """Put session ``i``'s next turn on the heap, due ``after`` plus its think time."""
        k = self.next_turn[i]
        if k >= len(self.sessions[i].turns):
            return
        turn = self.sessions[i].turns[k]
        ready = after + (turn.think_time_s if k > 0 else 0.0)
        if turn.arrival_s is not None:
            ready = max(ready, turn.arrival_s)
        if self.opts.max_duration_s is not None and ready >= self.opts.max_duration_s:
            return
        self.order += 1
        heapq.heappush(self.heap, _Due(ready, self.order, i))

    def can_issue(self, t: float) -> bool:
        """Is a turn due at run time ``t`` that the in-flight and request bounds admit?"""
        o = self.opts
        return bool(self.heap and self.heap[0].ready_at <= t
                    and (o.max_in_flight is None or len(self.inflight) < o.max_in_flight)
                    and (o.max_requests is None or self.issued < o.max_requests))

    def issue(self, bar: Any) -> None:
        """Submit the turn due first; a turn that cannot be rendered or is refused is recorded
        with its error (and its session stops: the history is broken)."""
        from deepinfer.chat import render_chat
        from deepinfer.errors import RequestError

        i = heapq.heappop(self.heap).session
        session = self.sessions[i]
        turn = session.turns[self.next_turn[i]]
        self.next_turn[i] += 1
        self.issued += 1
        rec = RequestRecord(
            request_id=turn.request_id or f"{session.session_id}-{self.next_turn[i]}",
            session_id=session.session_id, arrival_s=self.now(), first_token_s=None,
            finish_s=None, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
            ideal_cached_tokens=turn.ideal_cached_tokens)
        try:
            ids = turn.tokens()
            if ids is None:
                msgs = self.states[i].request_messages(turn)
                if self.text_tools:
                    msgs = to_text_messages(msgs)
                try:
                    ids = render_chat(self.backend.tokenizer, msgs)
                except Exception:  # noqa: BLE001 - a template without tool support
                    self.notes["template_fallbacks"] += 1
                    ids = render_chat(self.backend.tokenizer, to_text_messages(msgs))
            rec.prompt_tokens = len(ids)
            if self.ideal is not None and rec.ideal_cached_tokens is None:
                rec.ideal_cached_tokens = self.ideal.lookup(ids)
            rec.arrival_s = self.now()
            self.backend.submit(rec.request_id, ids, turn.max_tokens)
        except (RequestError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:500]
            self.records.append(rec)
            bar.update(1)
            return
        arrived = self.backend.arrival_time(rec.request_id)
        if arrived is not None:  # the backend's own add time, on the run clock
            rec.arrival_s = arrived - self.t0 + self.skipped_s
        self.inflight[rec.request_id] = (i, turn, rec, ids)

    def finish(self, f: Finished) -> None:
        """Record a finished request, extend its session's history, schedule the next turn."""
        i, turn, rec, ids = self.inflight.pop(f.request_id)
        base = self.skipped_s - self.t0
        rec.first_token_s = None if f.first_token_time is None else f.first_token_time + base
        rec.finish_s = f.finish_time + base
        rec.completion_tokens = len(f.output_ids)
        rec.cached_tokens = f.cached_tokens
        rec.cached_by_tier = dict(f.cached_by_tier)
        rec.prompt_tokens = f.prompt_tokens
        rec.error = f.error
        self.records.append(rec)
        if self.ideal is not None:
            self.ideal.add(ids + f.output_ids)
        self.states[i].add_reply(turn, f.text)
        self.schedule(i, rec.finish_s)

    def idle(self) -> bool:
        """Nothing runs: wait for (or skip to) the next due turn; False when none is left."""
        o = self.opts
        if not self.heap or (o.max_requests is not None and self.issued >= o.max_requests):
            return False
        wait = self.heap[0].ready_at - self.now()
        if wait > 0:
            if o.idle == "skip":
                self.skipped_s += wait
            else:
                time.sleep(min(wait, 1.0))
        return True


def drive(backend: Backend, workload: Workload, opts: DriveOptions | None = None,
          *, page_size: int | None = None) -> DriveResult:
    """Run every session of ``workload`` on ``backend`` (module doc); records in finish order."""
    from tqdm import tqdm

    opts = opts or DriveOptions()
    if opts.idle not in ("sleep", "skip"):
        raise ValueError("idle must be 'sleep' or 'skip'")
    run = _Drive(backend, workload, opts, page_size)
    total = workload.num_requests
    if opts.max_requests is not None:
        total = min(total, opts.max_requests)
    if opts.warmup:
        backend.submit("warmup", [(7 * k + 11) % backend.vocab_size for k in range(16)], 2)
        while backend.has_work():
            backend.step()
    bar = tqdm(total=total, desc=f"engine {opts.label or workload.name}", unit="req",
               disable=not opts.progress)
    run.t0 = time.perf_counter()
    for i in range(len(run.sessions)):
        run.schedule(i, 0.0)
    try:
        while True:
            t = run.now()
            while run.can_issue(t):
                run.issue(bar)
            if backend.has_work():
                for f in backend.step():
                    run.finish(f)
                    bar.update(1)
                continue
            if not run.idle():
                break
    finally:
        bar.close()
    ok = [r for r in run.records if r.ok]
    duration = (max(r.finish_s for r in ok) - min(r.arrival_s for r in ok)) if ok else 0.0  # type: ignore[type-var]
    run.notes["idle_skipped_s"] = run.skipped_s
    return DriveResult(records=run.records, duration_s=duration, stats=backend.stats(),
                       notes=run.notes)
