"""The one thread that touches the engine, fed by the HTTP event loop.

``LLMEngine`` is synchronous and not thread-safe, so exactly one thread (``deepinfer-engine``)
touches it — and the tokenizer, the prompt builder and the server's counters. That thread
loops: run the commands queued by the HTTP side, then ``engine.step()`` while there is work,
then hand the round's deltas to the event loop with one ``loop.call_soon_threadsafe``. When the
engine is idle the thread blocks on its command queue. The event loop never waits for a step,
and a step never waits for the event loop. ``AsyncEngine`` (``async_engine.py``) says what the
commands are and what a step publishes.

A step that raises as a whole is retried once on the next round; a second failure in a row
fails every live request (nobody waits on a broken engine), and from ``UNHEALTHY_AFTER``
failed steps in a row until a step succeeds ``healthy`` is False (``/health`` answers 503).
Error lines are rate-limited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..engine import LLMEngine
from ..log_limit import RateLimitedLog
from ..request import Request
from .api_error import APIError
from .live import deliver
from .outputs import Delta

log = logging.getLogger("deepinfer.server")

UNHEALTHY_AFTER = 2  # failed steps in a row that make /health answer 503


class EngineThread(ABC):
    """The engine's thread, its command queue and its outbox of deltas; health and shutdown."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._outbox: list[tuple[asyncio.Queue, Delta]] = []
        self._errors = RateLimitedLog(log)
        self._failed_steps = 0  # steps in a row that raised
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self._draining = False
        self._stop_now = False
        self.fatal: BaseException | None = None

    @abstractmethod
    def _step(self) -> None:
        """One engine step (``_engine_step``) and the deltas it makes."""

    @abstractmethod
    def _fail_all(self, message: str) -> None:
        """End every live request with an error delta."""

    # ================================================================== event-loop side
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Alive, and fewer than ``UNHEALTHY_AFTER`` steps in a row have failed."""
        return self.alive and self._failed_steps < UNHEALTHY_AFTER

    def _put(self, cmd: Callable[[], None]) -> None:
        if not self.alive:
            raise APIError(503, "the engine is not running", type="server_error",
                           code="engine_stopped")
        self._cmds.put(cmd)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread (between steps) and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(lambda: self._run_call(fn, fut))
        return await asyncio.wrap_future(fut)

    def call_sync(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """``call`` for code outside the event loop (tests, the CLI)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(lambda: self._run_call(fn, fut))
        return fut.result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let running ones finish (up to ``timeout``), flush, stop.

        Blocking; call it from a worker thread, not the event loop.
        """
        if not self.alive:
            return

        def drain() -> None:
            self._accepting = False
            self._draining = True

        self._cmds.put(drain)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shutdown: %d requests still running after %.0fs; aborting them",
                        len(self.engine.requests), timeout)

            def stop() -> None:
                self._fail_all("the server is shutting down")
                self._send_outbox()
                self._stop_now = True

            self._cmds.put(stop)
            self._thread.join(30.0)

    # ================================================================== engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                cmds = []
                if not eng.has_unfinished():
                    if self._draining or self._stop_now:
                        break
                    try:  # idle: promote recent conversations' L3 pages, woken while in flight
                        cmds.append(self._cmds.get(timeout=0.05 if eng.kv.on_idle() else None))
                    except queue.Empty:
                        continue
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    cmd()
                if self._stop_now:
                    break
                if eng.has_unfinished():
                    self._step()
                self._send_outbox()
        except BaseException as e:  # a bug in this loop: fail everyone rather than hang them
            log.exception("engine thread died")
            self.fatal = e
            self._fail_all(f"engine thread died: {e}")
            self._send_outbox()
            return
        finally:
            self._accepting = False
        self._run_leftovers()
        self._flush()

    def _run_leftovers(self) -> None:
        """Answer commands queued while the loop was ending (adds are refused with 503)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            try:
                cmd()
            except Exception:  # noqa: BLE001 - shutting down
                log.exception("command after shutdown failed")
        self._send_outbox()

    def _flush(self) -> None:
        """Let the cache tiers land what they hold (``engine.shutdown()`` waits for queued L2/L3
        writes and stops the tier threads)."""
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down: report, don't raise
            log.exception("flushing caches failed")

    def _run_call(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    def _send_outbox(self) -> None:
        """Hand this round's deltas to the event loop: one wake-up for all of them."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(deliver, batch)
        except RuntimeError:  # event loop closed: nobody is listening any more
            pass

    def _engine_step(self) -> list[Request] | None:
        """``engine.step()``: the requests it sampled; None if it raised."""
        eng = self.engine
        try:
            sampled = eng.step()
        except Exception as e:  # noqa: BLE001 - retried next round; twice in a row fails all
            self._failed_steps += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self._errors.error("step", "engine step failed (%d in a row): %s", self._failed_steps,
                               self.last_error, exc_info=True)
            if self._failed_steps >= 2:
                self._fail_all(f"engine error: {self.last_error}")
            return None
        self._failed_steps = 0
        if not sampled and not eng.scheduler.running:
            # Work is queued but nothing could be scheduled (should not happen: every
            # accepted request fits the pool). Wait for a command instead of spinning.
            try:
                self._cmds.get(timeout=0.01)()
            except queue.Empty:
                pass
        return sampled
