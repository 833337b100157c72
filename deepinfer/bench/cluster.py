"""Capacity planner, cluster: N replicas with local L1 (and L2) and, optionally, one KV pool
they all share (``--kv-store``), under a routing policy, replayed through the engine's own
cache code (``replay.py``).

Each replica is a ``replay._Replayer`` (its own radix tree, allocator and tier manager). The
shared pool is the replicas' L3: every replica's counting backend writes its pages into one
``SharedPool`` (an LRU set of page keys with a page budget) and its lookups probe it by key, as
an engine's lookups probe a networked store, so a page one replica computed is a hit for all.
A page the pool has evicted since a tree recorded it is a miss (the load stops there), as a
``RemoteStore`` miss is.

Routing (per request, in arrival order):

* ``round_robin``: request k goes to replica k mod N;
* ``least_load``: the replica with the fewest prompt tokens among the last ``N * concurrency``
  routed requests (the cluster's in-flight window);
* ``kv``: the least cost ``tokens to prefill - hit tokens of its local tree (L1/L2)``
  ``+ load_weight * load`` (load as for ``least_load``), the shape of Dynamo's KV router cost.

``ideal`` is ``ideal.ideal_hits`` (an unbounded cache of every prefix) and ``single`` one
replica holding all N replicas' memory: the bounds a cluster is compared with.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from deepinfer.bench.ideal import ideal_hits
from deepinfer.bench.replay import (DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_NODE_PAGES,
                                    CountingTierBackend, _PlanRequest, _Replayer, block_digests)
from deepinfer.bench.traces import TraceRequest
from deepinfer.kv.radix import DEVICE, DISK, HOST
from deepinfer.kv.tiers.backend import DiskKey, LoadJob
from deepinfer.kv.tiers.disk_file import PageId
from deepinfer.kv.tiers.policy import WRITE_THROUGH, TierPolicy

POLICIES = ("round_robin", "least_load", "kv")


class SharedPool:
    """Page keys in a pool every replica reads and writes, LRU within ``capacity`` pages."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[DiskKey, None] = OrderedDict()
        self.evicted = 0

    def put(self, keys: Sequence[DiskKey]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            self.evicted += 1

    def get(self, key: DiskKey) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def __contains__(self, key: DiskKey) -> bool:
        return key in self._keys


class PoolBackend(CountingTierBackend):
    """A replica's counting backend whose L3 is the shared pool: writes land there, lookups
    probe it, and a load reads the leading run of its L3 pages the pool still holds."""

    def __init__(self, pool: SharedPool, host_pages: int) -> None:
        super().__init__(host_pages, pool.capacity)
        self.pool = pool

    def device_to_disk(self, pages: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool:
        self.pool.put(keys)
        return super().device_to_disk(pages, keys, ids)

    def host_to_disk(self, slots: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool:
        self.pool.put(keys)
        return super().host_to_disk(slots, keys, ids)

    def disk_contains(self, key: DiskKey, indexed: bool = False) -> bool:
        return key in self.pool

    def start_load(self, job: LoadJob) -> None:
        tiers: list[int] = []
        for i, (tier, key) in enumerate(job.sources):
            if tier == DISK and not self.pool.get(key):
                job.failed_at = i
                break
            tiers.append(tier)
        if job.failed_at is None:
            for key in job.probe:
                if not self.pool.get(key):
                    break
                tiers.append(DISK)
        job.page_tiers = tiers
        job.num_loaded = len(tiers)
        job.done = True


@dataclass
class ClusterResult:
    policy: str
    replicas: int
    pool_tokens: int  # 0: local tiers only
    input_tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict[str, int]
    routed: list[int]  # requests per replica
    failed_requests: int
    pool_evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass
class _Replica:
    rp: _Replayer
    inflight: deque = field(default_factory=deque)


def simulate(trace: Sequence[TraceRequest], *, replicas: int, policy: str, page_size: int,
             l1_tokens: int, l2_tokens: int = 0, pool_tokens: int = 0, concurrency: int = 1,
             load_weight: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
             max_node_pages: int = DEFAULT_MAX_NODE_PAGES,
             digests: Sequence[Sequence[bytes]] | None = None) -> ClusterResult:
    """Replay ``trace`` over ``replicas`` engines routed by ``policy`` (module doc)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if replicas < 1 or concurrency < 1:
        raise ValueError("replicas and concurrency must be >= 1")
    ps = page_size
    pool = SharedPool(pool_tokens // ps) if pool_tokens else None
    fleet: list[_Replica] = []
    for _ in range(replicas):
        backend = PoolBackend(pool, l2_tokens // ps) if pool is not None else None  # pool = L3
        fleet.append(_Replica(_Replayer(ps, l1_tokens // ps, l2_tokens // ps, 0, chunk_tokens,
                                        max_node_pages, True, TierPolicy(WRITE_THROUGH), backend)))
    window: deque[tuple[int, int]] = deque()  # (replica, prompt tokens) of recent requests
    load = [0] * replicas
    routed = [0] * replicas
    by_tier = {"device": 0, "host": 0, "disk": 0}
    hits = failed = input_tokens = 0
    for k, r in enumerate(trace):
        d = digests[k] if digests is not None else block_digests(r)
        reqs = [f.rp.make_request(r, d) for f in fleet] if policy == "kv" else None
        if policy == "round_robin":
            i = k % replicas
        elif policy == "least_load":
            i = min(range(replicas), key=lambda j: (load[j], j))
        else:
            assert reqs is not None
            i = min(range(replicas), key=lambda j: (
                r.input_length - _local_hit(fleet[j].rp, reqs[j][0]) * ps + load_weight * load[j], j))
        req, n_out = reqs[i] if reqs is not None else fleet[i].rp.make_request(r, d)
        f = fleet[i]
        routed[i] += 1
        input_tokens += r.input_length
        window.append((i, r.input_length))
        load[i] += r.input_length
        if len(window) > replicas * concurrency:
            j, n = window.popleft()
            load[j] -= n
        if len(f.inflight) >= concurrency:
            failed += not f.rp.finish(*f.inflight.popleft())
        while not f.rp.admit(req):
            req.num_cached_tokens = None
            if not f.inflight:
                failed += 1
                break
            failed += not f.rp.finish(*f.inflight.popleft())
        else:
            f.inflight.append((req, n_out))
            hits += req.num_cached_tokens or 0
            for t, n in req.cached_tokens_by_tier.items():
                by_tier[t] += n
    for f in fleet:
        while f.inflight:
            failed += not f.rp.finish(*f.inflight.popleft())
    return ClusterResult(policy, replicas, pool_tokens, input_tokens, hits,
                         {t: n for t, n in by_tier.items() if n}, routed, failed,
                         pool.evicted if pool is not None else 0)


def _local_hit(rp: _Replayer, req: _PlanRequest) -> int:
    """Pages of ``req``'s prefix this replica's tree holds in L1 or L2 (no side effects on
    ages or hit counts)."""
    assert rp.kv.tree is not None
    m = rp.kv.tree.match(req.page_hashes, touch=False, count_hit=False)
    n = 0
    for node in m.path:
        if node.tiers[DEVICE] is None and node.tiers[HOST] is None:
            break
        n += node.num_pages
    return n


def compare(trace: Sequence[TraceRequest], *, replicas: int, page_size: int, l1_tokens: int,
            pool_tokens: int, l2_tokens: int = 0, concurrency: int = 1,
            policies: Sequence[str] = POLICIES) -> dict:
    """Hit rate per policy, local tiers only vs with the shared pool, next to one replica
    with all the fleet's memory and the ideal cache."""
    digests = [block_digests(r) for r in trace]
    kw = dict(replicas=replicas, page_size=page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
              concurrency=concurrency, digests=digests)
    rows = []
    for policy in policies:
        local = simulate(trace, policy=policy, **kw)
        shared = simulate(trace, policy=policy, pool_tokens=pool_tokens, **kw)
        rows.append({"policy": policy, "local": local.hit_rate, "shared": shared.hit_rate,
                     "gain": shared.hit_rate / local.hit_rate if local.hit_rate else None,
                     "routed": local.routed})
    single = simulate(trace, policy="round_robin", replicas=1, page_size=page_size,
                      l1_tokens=l1_tokens * replicas, l2_tokens=l2_tokens * replicas,
                      concurrency=concurrency * replicas, digests=digests)
    return {"replicas": replicas, "page_size": page_size, "l1_tokens": l1_tokens,
            "l2_tokens": l2_tokens, "pool_tokens": pool_tokens, "concurrency": concurrency,
            "requests": len(trace), "rows": rows, "single_all_memory": single.hit_rate,
            "ideal": ideal_hits(trace).hit_rate}
