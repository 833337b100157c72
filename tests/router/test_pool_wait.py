"""Requests held at the router for a pool peer's pages (``pool_wait.py``), without processes:
which leading pages a request must find in the pool on a worker, and a wait that ends when
the index shows them in the pool, or at its timeout."""

from __future__ import annotations

import asyncio

from deepinfer.router.index import PrefixIndex
from deepinfer.router.pool_wait import PoolWaits

PAGES = [bytes([i]) * 8 for i in range(6)]


def test_a_request_reaching_an_awaited_page_awaits_up_to_it():
    waits = PoolWaits(PrefixIndex(), timeout_s=1.0)
    assert waits.reach("b", PAGES) == 0
    waits.hold("b", PAGES[:3])
    waits.hold("b", PAGES[1:3])  # a second request awaiting some of them
    assert (waits.reach("b", PAGES), waits.reach("b", PAGES[:2]), waits.reach("a", PAGES)) == (
        3, 2, 0)
    waits.release("b", PAGES[:3])
    assert waits.reach("b", PAGES) == 3  # the second still awaits pages 1 and 2
    waits.release("b", PAGES[1:3])
    assert waits.reach("b", PAGES) == 0


def test_a_wait_ends_when_the_peer_wrote_the_pages_or_at_its_timeout():
    idx = PrefixIndex()
    idx.reset("a", {"device": [h.hex() for h in PAGES]})  # computed, not in the pool yet
    idx.reset("b", {"device": [PAGES[0].hex()]})

    async def run() -> tuple[bool, bool]:
        waits = PoolWaits(idx, timeout_s=30.0)
        task = asyncio.create_task(waits.wait("b", ["a"], PAGES[:4]))
        await asyncio.sleep(0.05)
        assert not task.done()
        idx.apply("a", [{"type": "stored", "tier": "disk", "hashes": [h.hex() for h in PAGES[1:4]]}])
        await waits.changed()
        landed = await asyncio.wait_for(task, 5.0)
        short = PoolWaits(idx, timeout_s=0.05)
        return landed, await short.wait("b", ["a"], PAGES)  # pages 4, 5 never come

    assert asyncio.run(run()) == (True, False)
