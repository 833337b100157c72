"""Which worker gets a request: ``kv`` (least work before its first token), ``round_robin``,
``least_load``.

``kv`` weighs, per worker, the pages the request would prefill there (its prompt minus the
leading pages the prefix index says the worker holds or has pending) against the work the
router already has open on it: the pages its requests still prefill, and a share per request
that is decoding (each step serves them too). ``overlap_weight`` > 1 counts a page computed
again as more than the wait it causes (the cluster computes it twice), which keeps requests
sharing a new prefix together. A worker whose device cache is nearly full pays for the pages
the request would push out of it (``evict_weight`` each): the pages it adds (prompt +
max_tokens, less its hit) beyond the free ones, free being the pool's size (from the worker's
snapshot) less the pages its events say it holds and those pending there; what a full worker
evicts is what its next turns would have hit. Ties go to the worker holding more of the prompt
(the same wait, fewer pages computed: a conversation's turn stays with its cache where the load
balances it out exactly), then to the less loaded, then in turn, so equal cold requests spread
out. Before any cost, a request continuing a conversation (``conversations.py``) stays on the
worker its previous turn went to, while that worker still holds more of the prompt than any
other and has at most ``stick_gap`` pages more open work than the least loaded candidate: the
cost sees one turn's recompute, not the dead copy a move leaves behind. ``least_load`` uses the
load alone (a PD decode worker too).

Workers sharing one KV pool (the same ``--kv-store``, from their snapshots) make the cluster's
copy of a prefix count once. A page the pool holds (a peer wrote it: the peer's L3 events) is a
hit on every peer, which loads it instead of computing it (``pool_weight`` of a prefilled page
each: a load is cheap, not free). A page a peer holds or is computing
but has not written yet would be computed a second time, though the pool will hold it soon: it
costs ``duplicate_weight`` more on a worker with open requests, so while the cluster is busy the
first requests of a new shared prefix (a system prompt, tool specs) gather where it is being
computed, which waits for it rather than computing it again (the scheduler's rule), and later
ones, spread by load, load it from the pool. On an idle worker (no open request) the term is
``idle_duplicate_weight`` (default 1, the same: the cluster computes a new shared prefix once,
which keeps a single engine's hit rate). At 0 an idle worker's copy costs only the wait: it takes
compute from no other request there, while waiting on the peer's prefill delays this one's first
token (a benchmark's first wave of agents all gathered on one worker while the other idled), at
the price of a second computed copy of the prefix. Instead of computing such pages, a request
may wait for them in the pool (``pool_wait.py``: the router holds it until the peer's events
say the pool has them; ``pool_waits``): that costs them as its own prefill (the wait is about
the peer computing them) plus a load each, no second copy, and is chosen where it costs less
(with the default weights, always, unless the worker is idle and ``idle_duplicate_weight`` is
below ``pool_weight``). So the first requests of a new shared prefix spread by load as without
a pool, and each worker but the one computing it loads it. Without a
shared pool each worker needs its own copy to serve the prefix at all, so that price is the
plain prefill the cost above already counts: the cost is then exactly the one above. Nor does
stickiness hold a conversation that another candidate can load from the pool: a move there
computes nothing again, and the copy it leaves behind is in the pool as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .conversations import Conversations
from .index import Overlap, PrefixIndex
from .prompts import RoutedPrompt
from .workers import Load, Worker


@dataclass
class Choice:
    worker: Worker
    overlap: Overlap  # the index's prediction for this worker
    page_size: int | None  # the worker's (None: not synced yet; no prediction)
    costs: dict[str, float] = field(default_factory=dict)  # kv: each candidate's, by URL
    sticky: bool = False  # kv: kept on its conversation's worker, whatever the costs
    awaits: int = 0  # pages a pool peer is computing that it waits for in the pool, then loads

    @property
    def predicted_hit_tokens(self) -> int:
        return (self.overlap.pages + self.overlap.pooled + self.awaits) * (self.page_size or 0)

    @property
    def pending_hit_tokens(self) -> int:
        return self.overlap.pending * (self.page_size or 0)

    @property
    def awaited_pages(self) -> int:
        """The leading pages of the prompt the pool must hold before it is sent (0: now)."""
        return self.overlap.pages + self.overlap.pooled + self.awaits if self.awaits else 0


@dataclass(frozen=True)
class CostWeights:
    overlap_weight: float = 1.0  # per page the request would prefill on the worker
    decode_weight: float = 1.0  # pages-worth of work per request decoding there
    evict_weight: float = 1.0  # per cached page the request would push out of the worker's L1
    stick_gap: float = 16.0  # pages of open work over the least loaded's that end stickiness
    duplicate_weight: float = 1.0  # per page it computes that a pool peer has (not yet pooled)
    idle_duplicate_weight: float = 1.0  # the same on a worker with no open request
    pool_weight: float = 0.1  # per page it loads from the shared pool (a prefilled page: 1)


def busy(load: Load, weights: CostWeights) -> float:
    """The work the router has open on a worker, in pages."""
    return load.prefill_pages + weights.decode_weight * load.decoding


def overflow(adds: int, free: int) -> int:
    """Cached pages a worker evicts to make room for ``adds`` new pages when ``free`` are free."""
    return max(0, adds - max(0, free))


def kv_cost(to_prefill: int, load: Load, weights: CostWeights, evicts: int = 0,
            duplicates: int = 0, pooled: int = 0) -> tuple[float, float]:
    """(cost, tie-break) of a worker that would prefill ``to_prefill`` pages under ``load``,
    pushing ``evicts`` cached pages out, ``duplicates`` of its pages a pool peer's too, and
    load ``pooled`` pages from the shared pool."""
    b = busy(load, weights)
    # an idle worker's second copy delays no other request (its own wait is in to_prefill)
    dup = weights.duplicate_weight if load.active_pages else weights.idle_duplicate_weight
    return (weights.overlap_weight * to_prefill + weights.evict_weight * evicts
            + dup * duplicates + weights.pool_weight * pooled + b, b)


def pool_peers(workers: list[Worker]) -> dict[str, list[str]]:
    """Per worker, the URLs of the others sharing its KV pool (none without one)."""
    return {w.url: [v.url for v in workers if v is not w and w.pool_id is not None
                    and v.pool_id == w.pool_id] for w in workers}


class Policy:
    def __init__(self, name: str, index: PrefixIndex, weights: CostWeights = CostWeights(),
                 conversations: Conversations | None = None, pool_waits: bool = True) -> None:
        self.name = name
        self.index = index
        self.weights = weights
        self.conversations = conversations or Conversations()
        self.pool_waits = pool_waits  # a request may wait for a peer's pages in the pool
        self._turn = itertools.count()

    def overlap(self, w: Worker, prompt: RoutedPrompt, peers: Sequence[str] = ()) -> Overlap:
        """``w``'s leading pages of ``prompt``, then those its pool ``peers`` wrote there."""
        if not w.synced or w.model_identity is None or w.page_size is None:
            return Overlap()
        hashes = prompt.page_hashes(w.model_identity, w.page_size)
        out = self.index.overlap(w.url, hashes)
        out.pooled = self.index.pooled(peers, hashes, out.pages)
        return out

    def duplicates(self, w: Worker, prompt: RoutedPrompt, hit: Overlap,
                   peers: Sequence[str]) -> int:
        """Pages ``w`` would compute that its pool ``peers`` hold or are computing."""
        if not peers or w.model_identity is None or w.page_size is None:
            return 0
        hashes = prompt.page_hashes(w.model_identity, w.page_size)
        return self.index.coming(peers, hashes, hit.pages + hit.pooled)

    def free_pages(self, w: Worker) -> int | None:
        """Device pages neither held nor pending on ``w`` (None: its pool size is not known)."""
        if not w.synced or w.cache_pages is None:
            return None
        return w.cache_pages - self.index.device_pages(w.url) - self.index.num_pending(w.url)

    def cost(self, w: Worker, prompt: RoutedPrompt, hit: Overlap, peers: Sequence[str] = ()
             ) -> tuple[float, float, int]:
        """(cost, tie-break, pages it awaits in the pool): computing the pages a pool peer is
        computing, or waiting for them there (see the module doc), whichever costs less."""
        free = self.free_pages(w)
        adds = prompt.pages(w.page_size) - hit.pages  # pooled pages land in its L1 too
        evicts = 0 if free is None else overflow(adds, free)
        to_prefill = prompt.prompt_pages(w.page_size) - hit.pages - hit.pooled
        dup = self.duplicates(w, prompt, hit, peers)
        computes = kv_cost(to_prefill, w.load, self.weights, evicts, dup, hit.pooled)
        if not (dup and self.pool_waits):
            return (*computes, 0)
        # the wait for a page the peer computes is about its prefill: it stays in to_prefill
        waits = kv_cost(to_prefill, w.load, self.weights, evicts, 0, hit.pooled + dup)
        return (*waits, dup) if waits[0] < computes[0] else (*computes, 0)

    def _holds_conversation(self, w: Worker, prompt: RoutedPrompt) -> bool:
        if not w.synced or w.model_identity is None or w.page_size is None:
            return False
        return self.conversations.holder(prompt.page_hashes(w.model_identity, w.page_size)
                                         ) == w.url

    def sticky(self, workers: list[Worker], prompt: RoutedPrompt,
               overlaps: dict[str, Overlap]) -> Worker | None:
        """The candidate ``prompt``'s conversation stays on, if any (see the module doc)."""
        if self.weights.stick_gap < 0:  # off
            return None
        home = next((w for w in workers if self._holds_conversation(w, prompt)), None)
        if home is None:
            return None
        others = [w for w in workers if w is not home]
        if not others:
            return home
        if overlaps[home.url].pages <= max(overlaps[w.url].pages + overlaps[w.url].pooled
                                           for w in others):
            return None  # its pages are gone (evicted) or in the pool: nothing to stay for
        gap = busy(home.load, self.weights) - min(busy(w.load, self.weights) for w in others)
        return home if gap <= self.weights.stick_gap else None

    def pick(self, workers: list[Worker], prompt: RoutedPrompt, use_cache: bool = True) -> Choice:
        """``workers``: the healthy candidates (not empty). ``use_cache`` False: by load only
        (a PD decode worker, whose cache the prefill worker's pages fill)."""
        assert workers
        turn = next(self._turn)
        order = workers[turn % len(workers):] + workers[: turn % len(workers)]
        peers = pool_peers(workers) if use_cache else {}
        overlaps = {w.url: self.overlap(w, prompt, peers.get(w.url, [])) for w in workers}
        if self.name == "round_robin":
            best = order[0]
        elif self.name == "least_load" or not use_cache:
            best = min(order, key=lambda w: (busy(w.load, self.weights), w.active_pages))
        else:
            costs = {w.url: self.cost(w, prompt, overlaps[w.url], peers[w.url]) for w in order}
            home = self.sticky(workers, prompt, overlaps)
            best = home or min(order, key=lambda w: (costs[w.url][0], -overlaps[w.url].pages,
                                                     costs[w.url][1]))
            return Choice(best, overlaps[best.url], best.page_size,
                          {u: c for u, (c, _, _) in costs.items()}, sticky=home is not None,
                          awaits=costs[best.url][2])
        return Choice(best, overlaps[best.url], best.page_size)
