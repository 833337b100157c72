"""Overlap scheduling (``--overlap-schedule``): the forward of step N runs on a worker thread
while the engine thread schedules step N+1 and lands step N-1 (stop checks, cache bookkeeping,
outputs).

Step N+1 is scheduled before step N's tokens are known: each request N samples gets a pending
token (``Request.num_pending_tokens``), its decode input in N+1 is a placeholder, and the worker,
which runs steps in submission order, fills it from N's samples right before N+1's forward
(SGLang's future token ids). A request that N finishes (stop token, stop string, max_tokens,
abort) was already scheduled in N+1: that token is computed and dropped. What must not race a
step in flight:

* the radix tree, the tiers and window snapshots only see KV that landed:
  ``cache_pages(req, num_tokens)`` with the count of the step being landed;
* no page a step in flight reads or writes goes to anyone else: the page allocators park freed
  pages (``PageAllocator.hold_frees``) and they are returned once every step launched before
  the free has landed; and the scheduler never preempts while a step is in flight (it reports
  ``blocked``; the flight lands first), since a preempted request's pending token would be lost.

The engine steps plainly while a request needs each token before its next sample: penalties and
grammars read the last token, an ``n``/``best_of`` request forks after its prompt, a
``prefill_only`` request ends when its prompt lands, speculative decoding verifies drafts. A step whose forward raises is rolled back (with the one
queued after it, which the worker skips) and run again as a plain step, whose fault isolation
fails the request that caused it alone.

Outputs are identical with overlap on and off: the same requests see the same inputs in the
same order, and every sampling request draws from its own generator.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from .kv.cache_manager import KVCacheManager
from .kv.pool import PageAllocator
from .layers.sampler import SampleResult
from .model_runner import ModelRunner, PreparedStep
from .request import Request
from .scheduler import Scheduler
from .spec.decoder import SpeculativeDecoder


class SteppingEngine(Protocol):
    """What the overlap scheduler uses of ``LLMEngine`` (which owns it): typed here so this
    module does not import the engine back."""

    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner
    spec: SpeculativeDecoder | None

    def plain_step(self) -> list[Request]: ...

    def wait_for_loads(self) -> None: ...

    def count_computed(self, req: Request, n: int) -> int: ...

    def commit(self, sampled: list[Request], result: SampleResult | None,
               failed: list[tuple[Request, Exception]]) -> list[Request]: ...

# what sampling a step gives: the requests that got a token, their tokens, those whose sampling raised
Sampled = tuple[list[Request], SampleResult | None, list[tuple[Request, Exception]]]


@dataclass(eq=False)
class InFlightStep:
    items: list[tuple[Request, int]]
    landed_tokens: list[int]  # per item: its computed-token count once this step has run
    prompt_tokens: list[int]  # per item: prompt tokens it computes (stats, undone on a rollback)
    sampled: list[Request]
    future: Future[Sampled]
    # pages freed while this was the newest step launched: reusable once it has landed
    held_pages: list[tuple[PageAllocator, list[int]]] = field(default_factory=list)


class SkippedStep(RuntimeError):
    """The step before this one raised, so this one (which may need its tokens) did not run."""


class OverlapScheduler:
    """Drives ``engine`` one step ahead: at most two steps are launched and not landed."""

    def __init__(self, engine: SteppingEngine) -> None:
        self.engine = engine
        self.runner: ModelRunner = engine.runner
        self.in_flight: InFlightStep | None = None  # the newest step launched
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step")
        window = self.runner.window
        self._allocators = [self.runner.pool.allocator] + (
            [window.rings.allocator] if window is not None else [])

    def step(self) -> list[Request]:
        """Schedule and launch the next step, then land the one launched before (its requests
        are what this returns)."""
        eng = self.engine
        if self._needs_sync():
            return self.drain() + eng.plain_step()
        flight = self.in_flight
        batch = eng.scheduler.schedule(preempt=flight is None)
        if batch.blocked or not batch.items:  # (blocked: preempt once the flight has landed)
            if flight is None:
                eng.wait_for_loads()
                return []
            return self._land(flight)
        try:
            self._launch(batch.items, flight)
        except Exception:  # noqa: BLE001 - preparing it raised: the plain step isolates the cause
            return self.drain() + eng.plain_step()
        return self._land(flight) if flight is not None else []

    def drain(self) -> list[Request]:
        """Land what is in flight (a step may compute tokens nobody keeps)."""
        return self._land(self.in_flight) if self.in_flight is not None else []

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)

    def _needs_sync(self) -> bool:
        eng = self.engine
        return eng.spec is not None or any(
            r.params.penalized or r.grammar is not None or r.params.prefill_only
            or (r.params.num_samples > 1 and r.group is None) for r in itertools.chain(eng.scheduler.running, eng.scheduler.waiting))

    def _launch(self, items: list[tuple[Request, int]], prev: InFlightStep | None) -> None:
        """Prepare ``items`` here (while ``prev`` runs), queue their forward after ``prev``, and
        advance the requests' counters as if the step had run."""
        step = self.runner.prepare(items)
        if step.pending and prev is None:
            raise RuntimeError("pending inputs without a step in flight to sample them")
        if prev is not None:  # freed while ``prev`` was the newest step: it may still use them
            prev.held_pages += [(alloc, alloc.take_held()) for alloc in self._allocators]
        for alloc in self._allocators:  # from now on a freed page may be one the new step uses
            alloc.hold_frees()
        future = self._pool.submit(self._run, step, prev)
        counted = [self.engine.count_computed(req, n) for req, n in items]
        for req in step.sampled:
            req.num_pending_tokens += 1
        self.in_flight = InFlightStep(items, [r.num_computed_tokens for r, _ in items], counted,
                                      step.sampled, future)

    def _run(self, step: PreparedStep, prev: InFlightStep | None) -> Sampled:
        """The worker: forward and sample ``step``, its pending inputs from ``prev``'s samples
        (``prev`` ran on this thread just before: it is done)."""
        if prev is not None and prev.future.exception() is not None:
            raise SkippedStep("the step before failed")
        tokens = None
        if step.pending:
            assert prev is not None
            reqs, result, _ = prev.future.result()
            tokens = dict(zip(reqs, result.tokens)) if result is not None else {}
        logits = self.runner.logits(step, tokens)
        if logits is None:
            return [], None, []
        return self.runner.sample(step.sampled, logits)  # a row that raises is in its failed list

    def _land(self, flight: InFlightStep) -> list[Request]:
        """Wait for ``flight``, commit its tokens, free the pages it was the last to use."""
        try:
            reqs, result, failed = flight.future.result()
        except Exception:  # noqa: BLE001 - its forward raised: rerun it plainly, isolated
            self._roll_back(flight)
            return self.engine.plain_step()
        eng = self.engine
        for req in flight.sampled:
            req.num_pending_tokens -= 1
        for (req, _), n in zip(flight.items, flight.landed_tokens):
            if not req.is_finished:  # (finished while a later step was in flight)
                try:
                    eng.kv.cache_pages(req, n)
                except Exception as e:  # noqa: BLE001
                    eng.scheduler.fail(req, e)
        out = eng.commit(reqs, result, failed)
        for alloc, pages in flight.held_pages:
            alloc.return_pages(pages)
        if self.in_flight is flight:  # the newest step landed: nothing in flight now
            self._end_flights()
        return out

    def _roll_back(self, failed: InFlightStep) -> None:
        """Undo the launch of ``failed`` and of the step queued after it (skipped), newest
        first, so a plain step computes their tokens again."""
        newest = self.in_flight
        flights = [failed] if newest is None or newest is failed else [newest, failed]
        if newest is not failed and newest is not None:
            newest.future.exception()  # wait until the worker skipped it
        stats = self.engine.kv.stats
        for f in flights:
            for (req, n), prompt in zip(reversed(f.items), reversed(f.prompt_tokens)):
                req.num_computed_tokens -= n
                stats.computed_prompt_tokens -= prompt
            for req in f.sampled:
                req.num_pending_tokens -= 1
            for alloc, pages in f.held_pages:
                alloc.return_pages(pages)
        self._end_flights()

    def _end_flights(self) -> None:
        """Nothing is in flight: parked pages are free, frees free at once again."""
        self.in_flight = None
        for alloc in self._allocators:
            alloc.release_hold()
