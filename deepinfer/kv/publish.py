"""A prompt's pages made durable in the networked store: a prefill worker's hand-over to a
decode worker (``server/pd.py``, DualPath: the KV reaches the decode worker from the store,
never through the client).

Write-through already queues the pages a prefill computes for the store, in the background.
The hand-over cannot rely on that alone (a write may be dropped under back-pressure, or the
pages may have been cached under another policy), so it checks: the prompt's full pages the
store lacked when the request arrived are waited for (their queued writes), looked up again
in one round trip, and those still missing are written now from L1 and acknowledged. A page
that cannot be published (store down, page no longer in L1) is counted; the decode worker
then computes it, so a failure costs time, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .cache_manager import KVCacheManager
from .hashing import chain_hashes
from .radix import DEVICE
from .tiers.disk_file import PageId, page_id
from .tiers.tier_io import TierIO


@dataclass
class PagePlan:
    """The full pages of one prompt: chained hashes, store keys, the page each key holds."""

    hashes: list[bytes]
    keys: list[str]
    ids: list[PageId]


@dataclass
class PublishResult:
    pages: int  # full pages of the prompt
    pages_present: int  # in the store when the request arrived
    pages_published: int  # put in the store for it (its writes waited for, or made now)
    pages_failed: int  # not in the store (store down, or the page left L1): decode computes them

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def plan_pages(kv: KVCacheManager, tiers: TierIO, token_ids: Sequence[int], salt: str | None
               ) -> PagePlan:
    """The full pages of ``token_ids`` (under ``salt``): hashes, L3 keys, page ids."""
    ps = kv.page_size
    hashes = chain_hashes(token_ids, ps, kv.root(salt))
    ids = [page_id(h, token_ids[i * ps : (i + 1) * ps]) for i, h in enumerate(hashes)]
    return PagePlan(hashes, [str(tiers.disk_key(h)) for h in hashes], ids)


def l1_pages(kv: KVCacheManager, plan: PagePlan) -> list[int]:
    """The L1 pages of the plan's leading pages still in the device pool (engine thread)."""
    assert kv.tree is not None
    m = kv.tree.match(plan.hashes, touch=False, count_hit=False)
    l1: list[int] = []
    for node in m.path:
        if node.tiers[DEVICE] is None:
            break
        l1 += node.tiers[DEVICE]
    return l1[: m.num_pages]


class StorePublisher:
    """Plans, checks and completes the publication of prompts' pages (see the module doc).
    ``plan`` and ``capture`` run on the engine thread; the others block on the store and run
    on any other thread."""

    def __init__(self, kv: KVCacheManager, tiers: TierIO | None) -> None:
        if tiers is None or tiers.remote is None:
            raise ValueError("a prefill worker needs a networked store (--kv-store URL)")
        if kv.tree is None:
            raise ValueError("a prefill worker needs the prefix cache (drop --no-prefix-cache)")
        self.kv = kv
        self.tiers = tiers
        self.remote = tiers.remote

    def plan(self, token_ids: Sequence[int], salt: str | None) -> PagePlan:
        return plan_pages(self.kv, self.tiers, token_ids, salt)

    def in_store(self, keys: list[str]) -> list[bool]:
        return self.remote.contains_many(keys)

    def wait_written(self, keys: list[str]) -> None:
        self.tiers.wait_written(keys)

    def capture(self, plan: PagePlan, missing: list[int]) -> Callable[[], list[bool]] | None:
        """A call that writes the pages of ``missing`` (indices into ``plan``) still in L1 to
        the store and returns its acks (None if none is in L1)."""
        l1 = l1_pages(self.kv, plan)
        have = [i for i in missing if i < len(l1)]
        if not have:
            return None
        return self.tiers.publish([l1[i] for i in have], [plan.keys[i] for i in have],
                                  [plan.ids[i] for i in have])
