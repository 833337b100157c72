"""Which worker gets a request: ``kv`` (least prefill + load cost), ``round_robin``,
``least_load``.

``kv`` is Dynamo's KV router cost: overlap_weight x (prompt pages the worker would have to
prefill, from the prefix index) + its active pages (of the requests the router has open on
it). Ties go to the less loaded worker, then in turn, so equal cold requests spread out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .index import Overlap, PrefixIndex
from .prompts import RoutedPrompt
from .workers import Worker


@dataclass
class Choice:
    worker: Worker
    overlap: Overlap  # the index's prediction for this worker
    page_size: int | None  # the worker's (None: not synced yet; no prediction)

    @property
    def predicted_hit_tokens(self) -> int:
        return self.overlap.pages * (self.page_size or 0)


class Policy:
    def __init__(self, name: str, index: PrefixIndex, overlap_weight: float = 1.0) -> None:
        self.name = name
        self.index = index
        self.overlap_weight = overlap_weight
        self._turn = itertools.count()

    def overlap(self, w: Worker, prompt: RoutedPrompt) -> Overlap:
        if not w.synced or w.model_identity is None or w.page_size is None:
            return Overlap()
        return self.index.overlap(w.url, prompt.page_hashes(w.model_identity, w.page_size))

    def pick(self, workers: list[Worker], prompt: RoutedPrompt, use_cache: bool = True) -> Choice:
        """``workers``: the healthy candidates (not empty). ``use_cache`` False: by load only
        (a PD decode worker, whose cache the prefill worker's pages fill)."""
        assert workers
        turn = next(self._turn)
        order = workers[turn % len(workers):] + workers[: turn % len(workers)]
        overlaps = {w.url: self.overlap(w, prompt) for w in workers}
        if self.name == "round_robin":
            best = order[0]
        elif self.name == "least_load" or not use_cache:
            best = min(order, key=lambda w: w.active_pages)
        else:
            def cost(w: Worker) -> tuple[float, int]:
                ps = w.page_size or 1
                prefill = -(-prompt.num_tokens // ps) - overlaps[w.url].pages
                return self.overlap_weight * prefill + w.active_pages, w.active_pages
            best = min(order, key=cost)
        return Choice(best, overlaps[best.url], best.page_size)
