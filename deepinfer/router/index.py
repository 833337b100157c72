"""The router's global prefix index: which worker holds which pages, in which tier.

Fed by the workers' KV events (``server/kv_events.py``). Chained page hashes cover every
token before them, so a worker holds a prompt's first k pages exactly when it holds the
hashes of pages 1..k; the index is a plain set of (hash -> tiers) per worker, no tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..kv.radix import TIER_NAMES

_TIER = {name: i for i, name in enumerate(TIER_NAMES)}


@dataclass
class Overlap:
    """A worker's leading cached pages of one prompt, per tier (where the first copy is)."""

    pages: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, dict[bytes, int]] = {}  # worker -> page hash -> tier bitmask

    def reset(self, worker: str, pages: dict[str, Sequence[str]]) -> None:
        """Replace what ``worker`` holds (a ``/kv/snapshot``: tier name -> hex hashes)."""
        held: dict[bytes, int] = {}
        for tier, hashes in pages.items():
            bit = 1 << _TIER[tier]
            for h in hashes:
                key = bytes.fromhex(h)
                held[key] = held.get(key, 0) | bit
        self._held[worker] = held

    def drop(self, worker: str) -> None:
        self._held.pop(worker, None)

    def apply(self, worker: str, events: Iterable[dict]) -> None:
        """Apply ``/kv/events`` entries (stored/removed, tier, hex hashes) in order."""
        held = self._held.setdefault(worker, {})
        for e in events:
            bit = 1 << _TIER[e["tier"]]
            if e["type"] == "stored":
                for h in e["hashes"]:
                    key = bytes.fromhex(h)
                    held[key] = held.get(key, 0) | bit
            else:
                for h in e["hashes"]:
                    key = bytes.fromhex(h)
                    left = held.get(key, 0) & ~bit
                    if left:
                        held[key] = left
                    else:
                        held.pop(key, None)

    def overlap(self, worker: str, hashes: Sequence[bytes]) -> Overlap:
        """How many leading pages of ``hashes`` the worker holds (any tier)."""
        held = self._held.get(worker, {})
        out = Overlap()
        for h in hashes:
            bits = held.get(h, 0)
            if not bits:
                break
            out.pages += 1
            out.by_tier[TIER_NAMES[(bits & -bits).bit_length() - 1]] += 1
        return out

    def num_pages(self, worker: str) -> int:
        return len(self._held.get(worker, {}))
