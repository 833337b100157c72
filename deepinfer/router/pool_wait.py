"""Requests held at the router until a pool peer's pages are in the shared KV pool.

When the kv cost sends a request to a worker that would otherwise compute again pages a peer
sharing its pool is computing (``Choice.awaits``), the router holds the request until the
peer's KV events say the pool has them, then sends it: the worker loads them instead of
computing a second copy, and its own work (the rest of the prompt, decoding) runs beside the
peer's instead of queueing behind it there. Those pages are pending on the worker meanwhile
(the next request sharing them follows it), so they are *awaited* there: any request sent to
that worker whose prompt reaches one of them waits for the pool too, instead of the worker
computing them. A wait ends when the pool has the pages, or after ``timeout_s`` (then the
worker computes what is missing, as without a wait).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from .index import PrefixIndex


class PoolWaits:
    def __init__(self, index: PrefixIndex, timeout_s: float) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self._awaited: dict[str, Counter[bytes]] = {}  # worker -> pages awaited there, by count
        self._changed = asyncio.Condition()

    def hold(self, worker: str, hashes: Sequence[bytes]) -> None:
        """``hashes`` (a routed request's leading pages) will reach ``worker`` from the pool."""
        self._awaited.setdefault(worker, Counter()).update(hashes)

    def release(self, worker: str, hashes: Sequence[bytes]) -> None:
        awaited = self._awaited.get(worker, Counter())
        awaited.subtract(hashes)
        for h in hashes:
            if awaited[h] <= 0:
                del awaited[h]

    def reach(self, worker: str, hashes: Sequence[bytes]) -> int:
        """How many leading pages of ``hashes`` must be in the pool before a request with them
        goes to ``worker``: up to the last one awaited there (0: none)."""
        awaited = self._awaited.get(worker)
        if not awaited:
            return 0
        return max((i + 1 for i, h in enumerate(hashes) if h in awaited), default=0)

    async def changed(self) -> None:
        """The index took new events: wake the waits."""
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, worker: str, peers: Sequence[str], hashes: Sequence[bytes]) -> bool:
        """Until ``worker`` holds or its ``peers`` wrote to the pool each of ``hashes``; False
        after ``timeout_s``."""
        def ready() -> bool:
            return self.index.servable(worker, peers, hashes)

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(ready), self.timeout_s)
            return True
        except TimeoutError:
            return False
