"""Capacity planner, replay: a block trace through the engine's own KV cache code, no model.

``replay`` drives ``deepinfer.kv.cache_manager.KVCacheManager`` (its ``RadixTree``,
``PageAllocator`` and, with lower tiers, the ``TierManager`` and ``TierPolicy``) with the very
calls the scheduler makes for a running request, so the hit accounting is the engine's
(``tests/bench/test_planner.py`` checks that per-request cached tokens, per-tier hits and
evictions equal a real engine's, L1 only and with L2 / L3 under each policy). ``sweep.plan``
replays a grid of L1 / L2 / L3 capacities and page sizes and finds the smallest sizes that
reach a target hit rate; ``plan_report`` writes JSON, Markdown and PNG curves.

Fast path (no tokens, no token hashing)
    A trace request is a chain of block ids. Each block gets the chained digest
    ``d_i`` of ``tokens.chain_digests`` (the key the benchmark's token generator draws the
    block's tokens from, so equal digests mean equal tokens). Page ``p`` (tokens
    ``[p*P, (p+1)*P)``) ends at token ``t = (p+1)*P - 1``, inside block ``i = t // B`` at
    offset ``o = t % B``; its key is ``d_i`` when ``o = B - 1`` (a page of B tokens is one
    block: the digest itself) else ``d_i || o``. The pair identifies the token prefix (blocks
    ``0..i-1`` whole plus the first ``o + 1`` tokens of block ``i``; a partial block is the
    prefix of the full one), so equal keys <=> equal token prefixes, the property the engine's
    chained page hashes have. Pages that reach past the hashed prompt tokens (a
    kv-cache-tester unhashed tail, the page the prompt ends in when the reply completes it,
    reply pages) get keys unique to the request: they occupy the cache but never hit, as in
    the engine (a reply is generated text no trace request repeats).

    The keys are handed to the cache manager as the request's ``page_hashes`` and the token
    list is a length-only stand-in (``_Length``), so ``KVCacheManager.match_prefix``,
    ``allocate``, ``cache_pages`` and ``release`` run unmodified and never hash or copy a
    token. The allocator hands out page ids lazily (``_LazyAllocator``), so a 200 M-token
    pool costs no memory up front.

Request lifetime and concurrency
    Requests are admitted in trace order. Admission = ``match_prefix`` then the prompt in
    chunks of ``chunk_tokens`` (the engine's ``max_num_batched_tokens``): ``allocate`` +
    ``cache_pages`` per chunk, as the scheduler and ``LLMEngine.step`` do. Finishing = the
    decode steps (``output_length - 1`` tokens get KV; only the steps that start or fill a
    page do anything, the others are no-ops in the engine too, so only those are replayed)
    then ``release``. A request holds its pages (its lock on the tree) from admission to
    finish. At most ``concurrency`` requests are in flight: before admitting a request the
    oldest one is finished when ``concurrency`` are already in flight (requests complete in
    arrival order). ``concurrency=1`` is exactly an engine with ``max_num_seqs=1`` fed the
    trace in order. When the pool cannot hold a new request's pages, the oldest in-flight
    requests are finished first (the engine would make it wait); a request that does not fit
    even alone counts in ``failed_requests`` and is skipped.

Capacities
    ``l1_tokens`` is the usable device pool (``l1_tokens // page_size`` pages; the engine's
    ``num_pages = N`` has ``N - 1`` usable pages, page 0 is padding). ``None`` = unbounded.

Lower tiers (L2 host, L3 disk)
    ``l2_tokens`` / ``l3_tokens`` give the cache manager the engine's own tier code
    (``kv.tiers.policy.TierManager`` with a ``TierPolicy``: write-through, write-back or
    selective after N hits) over ``CountingTierBackend``, the policy's counting backend, so
    placement, demotion, loads back into L1 and capacity accounting are the engine's; only
    the bytes do not move. Loads complete at once (the planner has no clock), so a request
    gets its whole L2/L3 prefix, as an engine whose loads finish before the request is
    scheduled. ``pages_moved`` counts pages per direction; with ``kv_bytes_per_token`` they
    become ``bytes_moved``.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer.bench.traces import TraceRequest
from deepinfer.config import EngineConfig
from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.pool import PageAllocator
from deepinfer.kv.radix import TIER_NAMES
from deepinfer.kv.tiers.backend import CountingBackend
from deepinfer.kv.tiers.policy import WRITE_THROUGH, TierPolicy
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

# the engine's defaults: prefill chunk (max_num_batched_tokens) and radix node cap
DEFAULT_CHUNK_TOKENS: int = EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default
DEFAULT_MAX_NODE_PAGES: int = EngineConfig.__dataclass_fields__["max_node_pages"].default
_PARAMS = SamplingParams(max_tokens=1)


# ---------------------------------------------------------------------------------- stand-ins
class _Length:
    """A token list the planner never materialises: only its length is real.

    ``KVCacheManager`` takes ``len()`` of a request's tokens and hands slices of them to the
    radix tree, which keeps a copy per node for explanations; iterating yields nothing, so
    nodes keep empty token lists and no memory.
    """

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> _Length:
        return _Length(len(range(*s.indices(self.n))))

    def __iter__(self):
        return iter(())


class _PlanRequest(Request):
    """A ``Request`` whose token lists are lengths (prompt and generated-so-far counts)."""

    def __init__(self, request_id: str, n_prompt: int, page_hashes: list[bytes]) -> None:
        super().__init__(request_id, [], _PARAMS)
        self.n_prompt = n_prompt
        self.n_generated = 0
        self.page_hashes = page_hashes

    @property
    def num_prompt_tokens(self) -> int:
        return self.n_prompt

    @property
    def num_tokens(self) -> int:
        return self.n_prompt + self.n_generated

    @property
    def all_token_ids(self) -> _Length:  # type: ignore[override]
        return _Length(self.n_prompt + self.n_generated)


class _LazyAllocator(PageAllocator):
    """``PageAllocator`` with the same free-list semantics, ids created on first use."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = []
        self._next = 1  # page 0 is reserved, as in the engine
        self._held: list[int] | None = None  # the planner never holds frees (no step in flight)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_pages - self._next

    def alloc(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        take = min(n, len(self._free))
        out = self._free[len(self._free) - take:][::-1] if take else []
        del self._free[len(self._free) - take:]
        if n > take:
            out += range(self._next, self._next + n - take)
            self._next += n - take
        return out


# ---------------------------------------------------------------------------------- page keys
def block_digests(req: TraceRequest) -> list[bytes]:
    from deepinfer.bench.tokens import chain_digests

    return chain_digests(req.namespace, req.block_ids)


_OFFSETS = [o.to_bytes(4, "little") for o in range(4096)]


def _offset(o: int) -> bytes:
    return _OFFSETS[o] if o < len(_OFFSETS) else o.to_bytes(4, "little")


def page_keys(digests: Sequence[bytes], block_size: int, hashed_tokens: int,
              page_size: int) -> list[bytes]:
    """Keys of the full pages inside the first ``hashed_tokens`` prompt tokens (see module doc)."""
    bs, ps = block_size, page_size
    n = hashed_tokens // ps
    if ps == bs:
        return list(digests[:n])
    if ps % bs == 0:  # a page = ps/bs whole blocks: the digest of its last block
        m = ps // bs
        return list(digests[m - 1: n * m: m])
    if bs % ps == 0:  # bs/ps pages per block
        suffix = _suffixes(bs, ps)
        nb, rem = divmod(n, len(suffix))
        out = [d + x for d in digests[:nb] for x in suffix]
        if rem:
            d = digests[nb]
            out += [d + x for x in suffix[:rem]]
        return out
    out = []
    for p in range(n):
        i, o = divmod((p + 1) * ps - 1, bs)
        out.append(digests[i] if o == bs - 1 else digests[i] + _offset(o))
    return out


@functools.lru_cache(maxsize=64)
def _suffixes(bs: int, ps: int) -> list[bytes]:
    """Key suffix of each page of a block (the last page's is empty: the block digest)."""
    return [_offset(o) for o in range(ps - 1, bs - 1, ps)] + [b""]


def _unique_keys(uid: int, start: int, stop: int) -> list[bytes]:
    head = b"u" + uid.to_bytes(8, "little")
    return [head + p.to_bytes(4, "little") for p in range(start, stop)]


# ---------------------------------------------------------------------------------- tiers
class CountingTierBackend(CountingBackend):
    """The tier policy's counting backend (moves nothing) with lazily created L2 slot ids
    and the page hash itself as L3 key: a 1 G-token L2 costs no memory, an L3 write no hash.
    """

    def __init__(self, host_pages: int = 0, disk_pages: int = 0) -> None:
        super().__init__(0, disk_pages)
        self.host_capacity = host_pages
        self._next_slot = 0

    def host_alloc(self, n: int) -> list[int] | None:
        free = len(self._free_slots) + self.host_capacity - self._next_slot
        if n > free:
            return None
        take = min(n, len(self._free_slots))
        out = self._free_slots[len(self._free_slots) - take:] if take else []
        del self._free_slots[len(self._free_slots) - take:]
        if n > take:
            out += range(self._next_slot, self._next_slot + n - take)
            self._next_slot += n - take
        return out

    def disk_key(self, page_hash: bytes) -> bytes:  # type: ignore[override]
        return page_hash


# ---------------------------------------------------------------------------------- replay
@dataclass
class ReplayResult:
    page_size: int
    l1_tokens: int | None
    l2_tokens: int
    l3_tokens: int
    concurrency: int
    requests: int
    input_tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict[str, int]
    evicted_pages: int
    pages_moved: dict[str, int]
    failed_requests: int
    seconds: float  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (the machine may be shared)
    tier_policy: str | None = None
    bytes_moved: dict[str, int] | None = None
    per_request_hits: list[int] | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_request_hits")
        d["hit_rate"] = self.hit_rate
        d["hit_rate_by_tier"] = {t: (n / self.input_tokens if self.input_tokens else 0.0)
                                 for t, n in self.hit_tokens_by_tier.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayResult:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


class _Replayer:
    def __init__(self, page_size: int, l1_pages: int, l2_pages: int, l3_pages: int,
                 chunk_tokens: int, max_node_pages: int, outputs: bool,
                 policy: TierPolicy | None, backend: CountingTierBackend | None = None) -> None:
        """``backend``: lower tiers of its own (the cluster planner's shared pool) instead
        of ``l2_pages`` / ``l3_pages`` counting ones."""
        self.ps = page_size
        self.chunk = chunk_tokens
        self.outputs = outputs
        if backend is None and (l2_pages or l3_pages):
            backend = CountingTierBackend(l2_pages, l3_pages)
        self.backend = backend
        self.kv = KVCacheManager(_LazyAllocator(l1_pages + 1), page_size, "deepinfer-planner",
                                 enable_prefix_cache=True, max_node_pages=max_node_pages,
                                 tiers=self.backend, policy=policy)
        self.uid = 0

    def make_request(self, r: TraceRequest, digests: Sequence[bytes]) -> tuple[_PlanRequest, int]:
        ps, n_in = self.ps, r.input_length
        n_out = max(1, r.output_length) if self.outputs else 1
        keys = page_keys(digests, r.block_size, r.hashed_tokens, ps)
        full = (n_in + n_out - 1) // ps  # full pages of KV when the request finishes
        if full > len(keys):
            keys += _unique_keys(self.uid, len(keys), full)
        self.uid += 1
        return _PlanRequest(r.request_id, n_in, keys), n_out

    def admit(self, req: _PlanRequest) -> bool:
        """Prefix match, then the prompt's chunks; False if the pool cannot hold it now."""
        kv = self.kv
        kv.match_prefix(req)
        n_in = req.n_prompt
        while req.num_computed_tokens < n_in:
            n = min(n_in - req.num_computed_tokens, self.chunk)
            if not kv.allocate(req, n):
                kv.release(req)
                return False
            req.num_computed_tokens += n
            kv.cache_pages(req)
        req.n_generated = 1  # the first token is sampled after the last prefill chunk
        return True

    def finish(self, req: _PlanRequest, n_out: int) -> bool:
        """Decode steps that start or fill a page, then release. False if a page was short."""
        kv, ps = self.kv, self.ps
        n_in = req.n_prompt
        end = n_in + n_out - 1  # tokens with KV when the last token is sampled
        c = n_in
        ok = True
        while c < end:
            if c % ps == 0:  # the token at c starts a page
                req.num_computed_tokens = c
                req.n_generated = c - n_in + 1
                if not kv.allocate(req, 1):
                    ok = False
                    break
            nxt = min(end, (c // ps + 1) * ps)
            req.num_computed_tokens = nxt
            req.n_generated = nxt - n_in + 1
            if nxt % ps == 0:
                kv.cache_pages(req)
            c = nxt
        kv.release(req)
        return ok


def replay(
    trace: Sequence[TraceRequest],
    *,
    page_size: int,
    l1_tokens: int | None,
    l2_tokens: int = 0,
    l3_tokens: int = 0,
    concurrency: int = 1,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    max_node_pages: int = DEFAULT_MAX_NODE_PAGES,
    outputs: bool = True,
    policy: str = WRITE_THROUGH,
    selective_hits: int = 2,
    kv_bytes_per_token: float | None = None,
    per_request: bool = False,
    digests: Sequence[Sequence[bytes]] | None = None,
) -> ReplayResult:
    """Replay ``trace`` (arrival order) through the engine's cache manager (module doc).

    ``policy`` / ``selective_hits``: the lower tiers' ``TierPolicy``. ``outputs=False`` treats every request as generating one token (prefill only: reply
    pages take no room). ``digests`` are ``block_digests`` of every request, precomputed
    (``plan`` shares them between grid points). ``per_request`` keeps every request's hit
    tokens (``per_request_hits``, trace order).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if chunk_tokens < page_size:
        raise ValueError("chunk_tokens must be >= page_size (as max_num_batched_tokens)")
    t0, c0 = time.perf_counter(), time.process_time()
    ps = page_size
    if l1_tokens is None:  # unbounded: enough pages for every page of every request
        l1_pages = sum((r.input_length + max(1, r.output_length)) // ps + 2 for r in trace)
    else:
        l1_pages = l1_tokens // ps
    rp = _Replayer(ps, l1_pages, l2_tokens // ps, l3_tokens // ps, chunk_tokens,
                   max_node_pages, outputs, TierPolicy(policy, selective_hits))
    kv = rp.kv
    inflight: deque[tuple[_PlanRequest, int]] = deque()
    hits: list[int] = []
    by_tier = dict.fromkeys(TIER_NAMES, 0)
    failed = 0
    input_tokens = 0
    for k, r in enumerate(trace):
        d = digests[k] if digests is not None else block_digests(r)
        req, n_out = rp.make_request(r, d)
        input_tokens += r.input_length
        if len(inflight) >= concurrency:
            failed += not rp.finish(*inflight.popleft())
        while not rp.admit(req):
            req.num_cached_tokens = None  # count it as a first attempt again
            if not inflight:
                break
            failed += not rp.finish(*inflight.popleft())
        else:
            inflight.append((req, n_out))
            hits.append(req.num_cached_tokens or 0)
            for t, n in req.cached_tokens_by_tier.items():
                by_tier[t] += n
            continue
        failed += 1  # does not fit even alone
        hits.append(0)
    while inflight:
        failed += not rp.finish(*inflight.popleft())
    moved = dict(rp.backend.moved) if rp.backend is not None else {}
    res = ReplayResult(
        page_size=ps, l1_tokens=l1_tokens, l2_tokens=l2_tokens, l3_tokens=l3_tokens,
        concurrency=concurrency, requests=len(hits), input_tokens=input_tokens,
        hit_tokens=int(sum(hits)), hit_tokens_by_tier={t: n for t, n in by_tier.items() if n},
        evicted_pages=kv.stats.evicted_pages, pages_moved=moved, failed_requests=failed,
        seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0, tier_policy=policy if rp.kv.tiers is not None else None,
        per_request_hits=hits if per_request else None)
    if kv_bytes_per_token is not None:
        res.bytes_moved = {k: int(v * ps * kv_bytes_per_token) for k, v in moved.items()}
    return res
