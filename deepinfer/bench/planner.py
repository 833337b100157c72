"""Cache capacity planner: replay a block trace through the engine's own KV cache code, no model.

``replay`` drives ``deepinfer.kv.cache_manager.KVCacheManager`` (its ``RadixTree``,
``PageAllocator`` and, with lower tiers, the ``TierManager`` and ``TierPolicy``) with the very
calls the scheduler makes for a running request, so the hit accounting is the engine's
(``tests/bench/test_planner.py`` checks that per-request cached tokens, per-tier hits and
evictions equal a real engine's, L1 only and with L2 / L3 under each policy). ``plan`` sweeps a grid of L1 / L2 / L3 capacities and page sizes and finds the
smallest sizes that reach a target hit rate; ``write_plan_report`` writes JSON, Markdown and
PNG curves.

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

Speed (Mooncake conversation trace, 12,031 requests, 145 M tokens, L1 = 10 M tokens, CPU
seconds of one core per grid point)
    page 16: 31 s on a quiet machine, since a request's inserts continue below the node it
    already owns (``RadixTree.insert(..., below=)``) instead of re-walking its prefix once per
    chunk and per filled reply page (72 s before, on a shared machine); page 512: 4.8 s and
    page 64: 12.7 s (before that change, shared machine). ``token_scale`` (lengths and block
    size scaled, same reuse structure) cuts it further: page 16 at ``token_scale=0.25`` (and
    L1 scaled alike) took 10.5 s.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
                 policy: TierPolicy | None) -> None:
        self.ps = page_size
        self.chunk = chunk_tokens
        self.outputs = outputs
        self.backend = CountingTierBackend(l2_pages, l3_pages) if (l2_pages or l3_pages) else None
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


# ---------------------------------------------------------------------------------- the grid
@dataclass
class PlanReport:
    trace: str
    requests: int
    input_tokens: int
    trace_ideal_hit_rate: float  # block granularity, infinite cache (bench/ideal.py)
    target: float | None
    points: list[ReplayResult]
    unbounded: dict[int, ReplayResult]  # per page size: infinite L1 (this engine's ideal)
    smallest: dict[int, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "trace_ideal_hit_rate": self.trace_ideal_hit_rate,
            "unbounded": {str(ps): r.as_dict() for ps, r in self.unbounded.items()},
            "target": self.target,
            "smallest": {str(ps): s for ps, s in self.smallest.items()},
            "points": [p.as_dict() for p in self.points],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanReport:
        """Back from ``plan.json`` (to re-plot or compare runs)."""
        return cls(
            trace=d["trace"], requests=d["requests"], input_tokens=d["input_tokens"],
            trace_ideal_hit_rate=d["trace_ideal_hit_rate"], target=d["target"],
            points=[ReplayResult.from_dict(p) for p in d["points"]],
            unbounded={int(k): ReplayResult.from_dict(v) for k, v in d["unbounded"].items()},
            smallest={int(k): v for k, v in d["smallest"].items()}, meta=d.get("meta", {}))


def parse_tokens(s: str) -> int:
    """``"1M"``, ``"200m"``, ``"64k"``, ``"1.5G"``, ``"4096"`` -> tokens (decimal units)."""
    s = s.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(s[-1:], 1)
    num = s[:-1] if mult != 1 else s
    return round(float(num) * mult)


def format_tokens(n: int | None) -> str:
    """``2M``, ``1.5M``, ``64k``; other sizes with thousands separators."""
    if n is None:
        return "inf"
    for unit, v in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= v:
            if (n * 100) % v == 0:
                return f"{n / v:g}{unit}"
            break
    return f"{n:,}"


def log_grid(lo: int, hi: int, n: int) -> list[int]:
    """``n`` capacities from ``lo`` to ``hi`` evenly spaced on a log scale, rounded to two
    significant digits (1M, 1.6M, 2.6M, ...)."""
    if n <= 1 or lo == hi:
        return [lo]
    out = set()
    for x in np.geomspace(lo, hi, n):
        e = 10 ** max(0, math.floor(math.log10(x)) - 1)
        out.add(round(x / e) * e)
    return sorted(out)


def smallest_sizes(points: Sequence[ReplayResult], target: float) -> dict[str, Any]:
    """Smallest grid sizes reaching ``target`` at one page size.

    ``l1_only``: the least L1 (no L2 / L3) reaching it; ``pareto``: every (L1, L2, L3) that
    reaches it with no other reaching point at most as large in every tier.
    """
    ok = [p for p in points if p.hit_rate >= target and p.failed_requests == 0]
    l1 = [p for p in ok if p.l2_tokens == 0 and p.l3_tokens == 0 and p.l1_tokens is not None]
    best = min(l1, key=lambda p: p.l1_tokens) if l1 else None  # type: ignore[arg-type,return-value]
    sizes = {(p.l1_tokens, p.l2_tokens, p.l3_tokens): p for p in ok if p.l1_tokens is not None}
    pareto = []
    for key, p in sizes.items():
        dominated = any(o != key and all(a <= b for a, b in zip(o, key)) for o in sizes)
        if not dominated:
            pareto.append({"l1_tokens": key[0], "l2_tokens": key[1], "l3_tokens": key[2],
                           "hit_rate": p.hit_rate})
    pareto.sort(key=lambda d: (d["l1_tokens"], d["l2_tokens"], d["l3_tokens"]))
    return {
        "target": target,
        "l1_only": None if best is None else {"l1_tokens": best.l1_tokens,
                                              "hit_rate": best.hit_rate},
        "pareto": pareto,
    }


def refine_l1(trace: Sequence[TraceRequest], target: float, lo: int, hi: int, *,
              page_size: int, tolerance: float = 0.02, max_steps: int = 12,
              **kw: Any) -> tuple[int, float, list[ReplayResult]]:
    """Bisect L1 (pages) between ``lo`` (misses ``target``) and ``hi`` (reaches it).

    Assumes the hit rate grows with capacity (LRU over a prefix tree almost always does;
    the grid shows it). Stops when ``hi / lo - 1 <= tolerance``. Returns (L1 tokens reaching
    the target, its hit rate, the points evaluated).
    """
    ps = page_size
    lo_p, hi_p = lo // ps, hi // ps
    evaluated = []
    best_rate = None
    for _ in range(max_steps):
        if hi_p - lo_p <= 1 or hi_p <= lo_p * (1 + tolerance):
            break
        mid = (lo_p + hi_p) // 2
        r = replay(trace, page_size=ps, l1_tokens=mid * ps, **kw)
        evaluated.append(r)
        if r.hit_rate >= target and r.failed_requests == 0:
            hi_p, best_rate = mid, r.hit_rate
        else:
            lo_p = mid
    return hi_p * ps, best_rate if best_rate is not None else float("nan"), evaluated


def plan(
    trace: Sequence[TraceRequest],
    *,
    page_sizes: Iterable[int] = (512,),
    l1: Iterable[int],
    l2: Iterable[int] = (0,),
    l3: Iterable[int] = (0,),
    target: float | None = None,
    target_of_ideal: float | None = None,
    refine: bool = False,
    name: str = "trace",
    progress: bool = True,
    **kw: Any,
) -> PlanReport:
    """Replay ``trace`` at every (page size, L1, L2, L3) of the grid, plus unbounded L1.

    ``target`` (a hit rate) or ``target_of_ideal`` (a fraction of the trace's ideal hit rate)
    selects the smallest sizes reaching it (``refine``: bisect L1 between grid points).
    """
    from tqdm import tqdm

    from deepinfer.bench.ideal import ideal_hits

    t0 = time.perf_counter()
    digests = [block_digests(r) for r in trace]
    prep_s = time.perf_counter() - t0
    ideal = ideal_hits(trace)
    if target is None and target_of_ideal is not None:
        target = target_of_ideal * ideal.hit_rate
    else:
        target_of_ideal = None
    grid = [(ps, a, b, c) for ps in page_sizes for a in l1 for b in l2 for c in l3]
    page_list = sorted({g[0] for g in grid})
    bar = tqdm(total=len(grid) + len(page_list), desc=f"plan {name}", unit="pt",
               disable=not progress)
    unbounded = {}
    for ps in page_list:
        unbounded[ps] = replay(trace, page_size=ps, l1_tokens=None, digests=digests, **kw)
        bar.update(1)
    points = []
    for ps, a, b, c in grid:
        points.append(replay(trace, page_size=ps, l1_tokens=a, l2_tokens=b, l3_tokens=c,
                             digests=digests, **kw))
        bar.set_postfix_str(f"P{ps} L1 {format_tokens(a)}: {100 * points[-1].hit_rate:.1f}%")
        bar.update(1)
    bar.close()
    smallest: dict[int, dict[str, Any]] = {}
    if target is not None:
        for ps in page_list:
            pts = [p for p in points if p.page_size == ps]
            s = smallest_sizes(pts, target)
            if refine and s["l1_only"] is not None:
                l1s = sorted(p.l1_tokens for p in pts  # type: ignore[misc]
                             if p.l2_tokens == 0 and p.l3_tokens == 0)
                hi = s["l1_only"]["l1_tokens"]
                below = [x for x in l1s if x < hi]
                if below:
                    tok, rate, extra = refine_l1(trace, target, below[-1], hi, page_size=ps,
                                                 digests=digests, **kw)
                    points.extend(extra)
                    if not math.isnan(rate):
                        s["l1_only_refined"] = {"l1_tokens": tok, "hit_rate": rate}
            smallest[ps] = s
    return PlanReport(
        trace=name, requests=len(trace), input_tokens=sum(r.input_length for r in trace),
        trace_ideal_hit_rate=ideal.hit_rate, target=target, points=points, unbounded=unbounded,
        smallest=smallest,
        meta={"prepare_seconds": prep_s, "total_seconds": time.perf_counter() - t0,
              "concurrency": kw.get("concurrency", 1),
              "chunk_tokens": kw.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
              "max_node_pages": kw.get("max_node_pages", DEFAULT_MAX_NODE_PAGES),
              "outputs": kw.get("outputs", True),
              "target_of_ideal": target_of_ideal,
              "tier_policy": kw.get("policy", WRITE_THROUGH)
              if any(p.tier_policy for p in points) else None})


# ---------------------------------------------------------------------------------- report
def write_plan_report(out_dir: str | Path, report: PlanReport, *, plots: bool = True) -> dict:
    """``plan.json``, ``plan.md`` and ``hit_rate_vs_capacity.png`` in ``out_dir``."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = report.as_dict()
    (out / "plan.json").write_text(json.dumps(doc, indent=2))
    (out / "plan.md").write_text(plan_markdown(report))
    if plots:
        plot_plan(report, out / "hit_rate_vs_capacity.png")
    return doc


def _pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def plan_markdown(report: PlanReport) -> str:
    lines = [f"# Cache capacity plan: {report.trace}", "",
             f"- requests: {report.requests:,}; input tokens: {report.input_tokens:,}",
             ("- ideal hit rate (infinite cache, block granularity): "
              f"{_pct(report.trace_ideal_hit_rate)}")]
    for ps, r in report.unbounded.items():
        lines.append(f"- unbounded L1 at page {ps} (what this engine reaches with infinite "
                     f"memory): {_pct(r.hit_rate)}")
    for k, v in report.meta.items():
        lines.append(f"- {k}: {v:.2f}" if isinstance(v, float) else f"- {k}: {v}")
    lines += ["", ("| page | L1 | L2 | L3 | hit rate | device | host | disk | / ideal | "
                   "evicted pages | failed | seconds (CPU) |"),
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sorted(report.points, key=lambda p: (p.page_size, p.l2_tokens, p.l3_tokens,
                                                  p.l1_tokens or 0)):
        t = p.hit_tokens_by_tier

        def frac(n: int, total: int = p.input_tokens) -> float:
            return n / total if total else 0.0

        lines.append(
            f"| {p.page_size} | {format_tokens(p.l1_tokens)} | {format_tokens(p.l2_tokens)} | "
            f"{format_tokens(p.l3_tokens)} | {_pct(p.hit_rate)} | "
            f"{_pct(frac(t.get('device', 0)))} | {_pct(frac(t.get('host', 0)))} | "
            f"{_pct(frac(t.get('disk', 0)))} | "
            f"{_pct(p.hit_rate / report.trace_ideal_hit_rate if report.trace_ideal_hit_rate else None)}"
            f" | {p.evicted_pages:,} | {p.failed_requests} | {p.seconds:.1f} "
            f"({p.cpu_seconds:.1f}) |")
    if report.target is not None:
        lines += ["", f"## Smallest sizes reaching {_pct(report.target)}", ""]
        for ps, s in report.smallest.items():
            one = s["l1_only"]
            lines.append(f"- page {ps}, L1 only: " + (
                "not reached on this grid" if one is None else
                f"{format_tokens(one['l1_tokens'])} tokens ({_pct(one['hit_rate'])})"))
            if s.get("l1_only_refined"):
                r = s["l1_only_refined"]
                lines.append(f"- page {ps}, L1 only, bisected: {r['l1_tokens']:,} tokens "
                             f"({_pct(r['hit_rate'])})")
            if any(d["l2_tokens"] or d["l3_tokens"] for d in s["pareto"]):
                lines.append(f"- page {ps}, minimal (L1, L2, L3): " + ", ".join(
                    f"({format_tokens(d['l1_tokens'])}, {format_tokens(d['l2_tokens'])}, "
                    f"{format_tokens(d['l3_tokens'])}) {_pct(d['hit_rate'])}"
                    for d in s["pareto"]))
    lines += ["", "![hit rate vs capacity](hit_rate_vs_capacity.png)", ""]
    return "\n".join(lines)


def plot_plan(report: PlanReport, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple[int, int, int], list[ReplayResult]] = {}
    for p in report.points:
        if p.l1_tokens is not None:
            groups.setdefault((p.page_size, p.l2_tokens, p.l3_tokens), []).append(p)
    multi_page = len({k[0] for k in groups}) > 1
    tiered = any(b or c for _, b, c in groups)
    for (ps, b, c), pts in sorted(groups.items()):
        pts.sort(key=lambda p: p.l1_tokens)  # type: ignore[arg-type,return-value]
        label = []
        if multi_page or not tiered:
            label.append(f"page {ps}")
        if b or c:
            label.append(f"L2 {format_tokens(b)}, L3 {format_tokens(c)}")
        elif tiered:
            label.append("L1 only")
        ax.plot([p.l1_tokens for p in pts], [p.hit_rate for p in pts], "o-", ms=3,
                label=", ".join(label) or "L1")
    ax.axhline(report.trace_ideal_hit_rate, color="k", ls="--", lw=1,
               label=f"ideal (infinite cache) {100 * report.trace_ideal_hit_rate:.1f}%")
    if report.target is not None:
        frac = report.meta.get("target_of_ideal")
        ax.axhline(report.target, color="tab:red", ls=":", lw=1,
                   label=f"target {100 * report.target:.1f}%"
                   + (f" ({100 * frac:g}% of ideal)" if frac else ""))
        for ps, s in report.smallest.items():
            best = s.get("l1_only_refined") or s.get("l1_only")
            if best is not None:
                x = best["l1_tokens"]
                ax.axvline(x, color="tab:red", ls=":", lw=1)
                ax.annotate(f"{format_tokens(x) if x % 10**5 == 0 else f'{x / 1e6:.1f}M'}"
                            + (f" (page {ps})" if multi_page else ""),
                            (x, report.target), textcoords="offset points", xytext=(4, -14),
                            fontsize=8, color="tab:red")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_tokens(int(v)) if v >= 1
                                               else ""))
    ax.set_xlabel("L1 (device) capacity, tokens")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, max(1e-3, min(1.0, 1.1 * max(
        [report.trace_ideal_hit_rate] + [p.hit_rate for p in report.points]))))
    ax.set_title(f"{Path(report.trace).stem}: hit rate vs cache capacity "
                 f"({report.requests:,} requests, {report.input_tokens / 1e6:.0f}M tokens)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
