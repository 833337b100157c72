"""Idle-time promotion: while the engine has nothing to run, bring the L3-only pages of the
conversations that ended most recently back to L2, so a next turn loads from host memory.

The cache manager reports each request's cached chain when it ends (``remember``); the engine
thread calls ``on_idle`` while idle. Per idle period (reset by ``end_idle``, at the next step)
at most ``max_bytes`` and ``max_pages`` are promoted (a node that does not fit what is left is
skipped, smaller ones still may). A node is promoted whole: it gets L2 slots
(free ones, or those of L2 nodes last used before it, evicted as usual), stays locked while an
L3 -> L2 read runs in the background, and gains its L2 tier only once every page read back
intact (``poll``), so a failed read is a miss and never garbage in the tree. Nothing here
blocks: a scheduled step never waits for a promotion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ..radix import DEVICE, DISK, HOST, Node, RadixTree
from .backend import TierBackend
from .disk_file import PageId

RECENT_CHAINS = 32  # conversations remembered, most recent first
RoomFn = Callable[[int, int], bool]  # (pages, older_than) -> L2 has that many free slots now
PageIdsFn = Callable[[list[bytes], Sequence[int] | None], list[PageId]]


@dataclass(eq=False)
class _Promotion:
    node: Node
    keys: list
    slots: list[int]
    done: Future


class IdlePromoter:
    def __init__(self, tree: RadixTree, backend: TierBackend, page_bytes: int, max_bytes: int,
                 max_pages: int, room: RoomFn, page_ids: PageIdsFn) -> None:
        self.tree, self.backend = tree, backend
        self.page_bytes = max(1, page_bytes)
        self.max_pages = min(max_pages, max_bytes // self.page_bytes)
        self._room = room
        self._page_ids = page_ids
        self._recent: deque[list[bytes]] = deque(maxlen=RECENT_CHAINS)
        self._todo: list[list[bytes]] = []  # this idle period's chains still to walk
        self._flight: list[_Promotion] = []
        self._spent = 0  # pages promoted (or in flight) this idle period
        self.counters = dict.fromkeys(["promoted_pages", "promotions", "promotions_dropped",
                                       "idle_periods"], 0)
        self._idle = False

    def remember(self, hashes: list[bytes]) -> None:
        """A request ended with these chain pages in the tree (its conversation so far); the
        chains it extends (earlier turns: chained hashes, so a shared last page is a prefix)
        are forgotten."""
        if not hashes:
            return
        for old in [c for c in self._recent if len(c) <= len(hashes) and hashes[len(c) - 1] == c[-1]]:
            self._recent.remove(old)
        self._recent.appendleft(list(hashes))

    def end_idle(self) -> None:
        """The engine runs a step: the next idle period gets a fresh budget."""
        self._idle = False

    def on_idle(self) -> bool:
        """Start promotions within this idle period's budget; True while any is in flight (call
        again soon), False when there is nothing left to do."""
        if not self._idle:  # a new period walks the remembered chains once, most recent first
            self._idle, self._spent, self._todo = True, 0, list(self._recent)
            self.counters["idle_periods"] += 1
        self.poll()
        while self._todo and self._spent < self.max_pages:
            hashes = self._todo.pop(0)
            for node in self.tree.match(hashes, touch=False, count_hit=False).path:
                # a node over what is left of the budget is skipped, not a stop: one node
                # larger than a whole period's budget would otherwise block every later one
                if node.tiers[DEVICE] is None and node.tiers[HOST] is None and \
                        node.tiers[DISK] is not None and self._spent + node.num_pages <= self.max_pages:
                    self._start(node)
        return bool(self._flight)

    def _start(self, node: Node) -> None:
        n = node.num_pages
        if not self._room(n, node.last_access):
            return
        slots = self.backend.host_alloc(n)
        if not slots:
            return
        keys = list(node.tiers[DISK] or [])
        ids: list[PageId] = self._page_ids(node.hashes, node.tokens)
        self.tree.lock(node)  # neither evicted nor dropped while its pages are read
        self._flight.append(_Promotion(node, keys, slots,
                                       self.backend.disk_to_host(keys, ids, slots)))
        self._spent += n

    def poll(self) -> None:
        """Give the nodes whose reads finished their L2 slots (or free the slots)."""
        done = [p for p in self._flight if p.done.done()]
        self._flight = [p for p in self._flight if not p.done.done()]
        for p in done:
            self.tree.unlock(p.node)
            ok = p.done.exception() is None and p.done.result()
            node = p.node
            if ok and node.parent is not None and node.tiers[HOST] is None \
                    and node.tiers[DISK] == p.keys:
                self.tree.add_tier(node, HOST, p.slots)
                self.counters["promoted_pages"] += node.num_pages
                self.counters["promotions"] += 1
            else:  # unreadable, or the node changed meanwhile (split, loaded, dropped)
                self.backend.host_free(p.slots)
                self.counters["promotions_dropped"] += 1

    def stats(self) -> dict[str, int]:
        return {**self.counters, "in_flight": len(self._flight)}
