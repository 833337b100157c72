"""The event-loop side of one request's delta queue: the next delta (merged with those already
queued, so a slow client gets fewer, larger chunks) and the client's disconnect.

A client disconnect is noticed by a task that waits for the ASGI ``http.disconnect`` message;
it aborts the request (its pages go back) and wakes whoever waits on the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from .outputs import Delta, merge_deltas

_DISCONNECTED = object()


async def await_disconnect(request: Request, q: asyncio.Queue,
                           on_disconnect: Callable[[], None]) -> None:
    """When the client goes away (after the body was read): ``on_disconnect()`` and put
    ``_DISCONNECTED`` in ``q`` for whoever waits on it."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                on_disconnect()
                q.put_nowait(_DISCONNECTED)
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - nothing more to learn from this connection
        return


async def next_delta(q: asyncio.Queue, merge: bool = True) -> Delta | None:
    """The next delta, merged with any others already queued (one choice only: deltas of
    several interleave); None once the client left."""
    d = await q.get()
    while merge and d is not _DISCONNECTED and not d.final and not q.empty():
        nxt = q.get_nowait()
        if nxt is _DISCONNECTED:
            q.put_nowait(nxt)  # seen on the next call
            break
        d = merge_deltas(d, nxt)
    return None if d is _DISCONNECTED else d


async def deltas_to_final(q: asyncio.Queue, watcher: asyncio.Task,
                          abort: Callable[[], None]) -> AsyncIterator[Delta]:
    """A request's deltas up to its final one; ``abort()`` if the reader stops early."""
    done = False
    try:
        while True:
            d = await next_delta(q)
            if d is None:
                return
            done = d.final
            yield d
            if done:
                return
    finally:
        watcher.cancel()
        if not done:
            abort()
