"""Which layers form the window group, and the ring sizes and replay span their windows imply.

Full-attention layers (and MLA, and any layer whose cache a full-attention layer reads) keep
every token in the ``PagePool``, addressed by the page ids that the radix tree and the lower
tiers (L2/L3) deal in. Sliding-window layers (``KVSpec.window``) keep their K/V in a separate
``WindowPool`` with its own allocator: each running sequence owns a *ring* of
``R = ceil((W - 1 + C) / page_size) + 1`` pages, position p living in ring slot
``(p // page_size) % R``. W is the largest window of the group, C the largest prefill chunk of
one sequence: the scheduler caps a hybrid model's chunks at C (``window_chunk_tokens``, default
W rounded up to a page), because a chunk's queries need the W - 1 tokens before the chunk and the
chunk itself in the ring at once (the model stores a step's K/V before attending). So chunked
prefill stays exact, a decode gathers only the ceil((W - 1) / page_size) + 1 pages its window
spans, and sliding-layer memory is O(W + C) per sequence however long it grows, while the full
group grows with the sequence. The page pool holds only the full group's buffers (window layers
get empty stand-in specs there), so tier copies (``PagePool.read_pages/write_pages`` over
``owned_buffers``) move exactly the bytes a tree page stands for; models without window layers
are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..layout import KVSpec

REPLAY_ALL = 1 << 62  # ``replay_tokens`` of a group no replay from a boundary > 0 restores


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class WindowLayout:
    """Which layers keep their KV in rings, and the numbers that follow from their windows."""

    layers: frozenset[int]  # owners and the layers reading their caches
    owners: tuple[int, ...]  # layers whose ring buffers exist (in order)
    window: int  # the largest window of the group (what a ring must cover)
    replay_tokens: int  # exact boundary replay: sum of (window - 1) over the group's layers,
    # or REPLAY_ALL when a ring feeds paged state (KVSpec.feeds_pages): then replay from 0

    @staticmethod
    def from_specs(specs: Sequence[KVSpec]) -> WindowLayout | None:
        """The window group of a model, or None when it has no sliding-window layer.

        A window layer's cache goes to a ring unless a full-attention layer reads it
        (cross-layer sharing): that reader needs every token, so the cache stays paged."""
        readers: dict[int, list[int]] = {}
        for i, s in enumerate(specs):
            if s.share_with is not None:
                readers.setdefault(s.share_with, []).append(i)
        layers: set[int] = set()
        owners: list[int] = []
        for i, s in enumerate(specs):
            if not s.owns_cache or s.window is None:
                continue
            if any(specs[r].window is None for r in readers.get(i, ())):
                continue
            owners.append(i)
            layers.add(i)
            layers.update(readers.get(i, ()))
        if not owners:
            return None
        if any(specs[i].tokens_per_entry != 1 for i in layers):
            raise ValueError("window specs hold one entry per token")
        windows = [specs[i].window for i in layers]
        replay = REPLAY_ALL if any(specs[i].feeds_pages for i in layers) else sum(w - 1 for w in windows)
        return WindowLayout(frozenset(layers), tuple(owners), max(windows), replay)

    def page_specs(self, specs: Sequence[KVSpec]) -> list[KVSpec]:
        """What the page pool holds per layer: group layers keep their window and sharing but no
        components (no buffers, no bytes in a page, a distinct cache namespace)."""
        return [KVSpec((), s.window, s.share_with) if i in self.layers else s
                for i, s in enumerate(specs)]

    def chunk_tokens(self, page_size: int, max_num_batched_tokens: int,
                     requested: int | None = None) -> int:
        """Largest prefill chunk of one sequence (what the ring is sized for)."""
        c = requested or cdiv(self.window, page_size) * page_size
        return max(1, min(c, max_num_batched_tokens))

    def ring_pages(self, page_size: int, chunk: int) -> int:
        return cdiv(self.window - 1 + chunk, page_size) + 1

    def decode_pages(self, page_size: int) -> int:
        """Pages a decode's window spans at most."""
        return cdiv(self.window - 1, page_size) + 1

