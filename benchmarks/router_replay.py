"""The router's placements replayed under measured step prices, without the machine's noise.

On the shared 2-core machine one ``router.py`` round swings TTFT by more than the policies
differ. This replays its quick workloads instead: the real ``Policy`` and ``PrefixIndex`` (the
router's code, each request's prompt hashed as the router does) route the client's closed
loop (``--concurrency`` requests in flight, waiting turns first come first served) to two
modelled workers. A worker runs the engine scheduler's rules: continuous batching under a
2048-token step budget, a request starts from its longest cached prefix (its device pool's
LRU, pages of running requests pinned; decode pages are not counted), waits while another request computes its next pages
(``KVCacheManager.joins_computing``) or while its pool pages load, and reports stored and
evicted pages to the index as KV events do; with a shared pool every computed page is written
through to it, and a request the policy sends to wait for a peer's pages in the pool is held
(as the router holds it) until they are written. A step costs ``a + b x tokens computed + c x sequences decoding``, prices
measured on the real model (single-thread CPU time, which other processes' load barely moves)
or given by ``--prices``. Step times get a log-normal jitter (``--jitter``), one seed per run,
so runs differ in arrival order as real ones do.

A model, not a measurement: what it shows is which requests wait where under each policy
(``--show``), to explain a ``router.py`` run and to try a cost change before measuring it.

    python benchmarks/router_replay.py [--workloads agent,chat] [--runs 40] [--show 0]
        [--configs single_engine_2x,round_robin,kv,kv/pool,kv@stick-gap=-1]
        [--prices 0.04,0.0033,0.01]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from router import POOL, front_args

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.router.index import PrefixIndex
from deepinfer.router.policy import Choice, CostWeights, Policy
from deepinfer.router.pool_wait import PoolWaits
from deepinfer.router.prompts import RoutedPrompt
from deepinfer.router.workers import Routed, Worker
from deepinfer.server.protocol import parse_request

PS = 16  # tokens per page, the workers' default
IDENTITY = "replay"
BUDGET = 2048  # EngineConfig.max_num_batched_tokens
EVENT_S = 0.02  # a KV event's way to the router's index
LOAD_S_PER_PAGE = 0.003  # a page loaded from the shared pool (prefetched while queued)
SINGLE = "single_engine_2x"  # one worker with both workers' pages (any policy: one choice)


@dataclass(frozen=True)
class Prices:
    """Seconds per step: ``step + token x tokens computed + decode x sequences decoding``."""

    step: float
    token: float
    decode: float

    def of(self, tokens: int, decoding: int) -> float:
        return self.step + self.token * tokens + self.decode * decoding


def measure_prices() -> Prices:
    """Single-thread CPU time of prefills of 64 and 640 tokens and of 16 decode steps at batch
    1 and 4 on the embedded model (best of 3)."""
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(threads=1, num_pages=256, max_model_len=2048)
    rng = random.Random(0)

    def cpu(n: int, batch: int, out: int) -> float:
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(3):
            prompts = [[rng.randrange(1000, 20000) for _ in range(n)] for _ in range(batch)]
            t0 = time.thread_time()
            llm.generate(prompts, params)
            best = min(best, time.thread_time() - t0)
        return best

    cpu(32, 1, 1)  # warm-up
    p64, p640 = cpu(64, 1, 1), cpu(640, 1, 1)
    d1, d4 = (cpu(64, 1, 17) - p64) / 16, (cpu(64, 4, 17) - cpu(64, 4, 1)) / 16
    token = (p640 - p64) / 576
    decode = max(0.0, (d4 - d1) / 3)
    return Prices(step=max(0.0, d1 - decode), token=token, decode=decode)


@dataclass
class Request:
    turn: tuple[int, int]  # (session, turn)
    tokens: list[int]
    reply: list[int]  # what it generates (the next turn's prompt continues with it)
    arrive: float
    hashes: list[bytes] = field(default_factory=list)
    computed: int = 0  # prompt tokens computed or hit
    decoded: int = 0
    ready: float = 0.0  # its pool pages are loaded
    hit: int = 0  # tokens it found cached
    first: float | None = None
    held: list[bytes] = field(default_factory=list)  # pages it pins
    worker: str = ""
    routed: Routed | None = None  # the load the router put on its worker


class ModelWorker:
    """One worker's scheduler and device pool (``scheduler.py``'s rules, see the module doc)."""

    def __init__(self, cluster: Cluster, url: str, pages: int) -> None:
        self.cluster, self.url, self.capacity = cluster, url, pages - 1  # one page kept back
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # LRU, oldest first
        self.pins: dict[bytes, int] = {}
        self.computing: set[bytes] = set()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.busy = False

    def add(self, r: Request) -> None:
        own = self._match(r.hashes, 0)
        pooled = self._pooled(r.hashes, own)
        r.ready = self.cluster.now + LOAD_S_PER_PAGE * pooled
        self.waiting.append(r)
        if not self.busy:
            self.step()

    def _match(self, hashes: list[bytes], start: int) -> int:
        n = start
        while n < len(hashes) and hashes[n] in self.cache:
            n += 1
        return n - start

    def _pooled(self, hashes: list[bytes], start: int) -> int:
        pool, n = self.cluster.pool, start
        while pool is not None and n < len(hashes) and hashes[n] in pool:
            n += 1
        return n - start

    def _room(self, need: int) -> bool:
        """Evict unpinned pages (oldest first) until ``need`` more fit; False if they cannot."""
        gone = []
        for h in list(self.cache):
            if len(self.cache) + need <= self.capacity - self._unhashed():
                break
            if not self.pins.get(h):
                del self.cache[h]
                gone.append(h)
        self.cluster.event(self.url, "removed", "device", gone)
        return len(self.cache) + need <= self.capacity - self._unhashed()

    def _unhashed(self) -> int:
        """Pages running requests hold outside the tree: the rest of their prompts."""
        return sum(-(-len(r.tokens) // PS) - len(r.held) for r in self.running)

    def _admit(self, r: Request) -> bool:
        start = self._match(r.hashes, 0)
        start += self._pooled(r.hashes, start)
        if start < len(r.hashes) and r.hashes[start] in self.computing:
            return False  # another request computes its next pages: it waits for them
        own = [h for h in r.hashes[:start] if h in self.cache]
        for h in own:  # its cached prefix is not evicted to make its own room
            self.pins[h] = self.pins.get(h, 0) + 1
        fits = self._room(-(-len(r.tokens) // PS) - len(own))
        for h in own:
            self.pins[h] -= 1
        if not fits:
            return False
        self._store(r, r.hashes[:start], pin=True)  # pool pages land in L1 (and the tree)
        r.computed = r.hit = start * PS
        self.computing.update(r.hashes[start:])
        return True

    def step(self) -> None:
        now, budget, items = self.cluster.now, BUDGET, []
        for r in self.running:
            if r.computed < len(r.tokens):
                n = min(budget, len(r.tokens) - r.computed)
                items.append((r, n))
                budget -= n
        for r in list(self.waiting):
            if budget > 0 and r.ready <= now and self._admit(r):
                self.waiting.remove(r)
                self.running.append(r)
                n = min(budget, len(r.tokens) - r.computed)
                items.append((r, n))
                budget -= n
        decoding = [r for r in self.running if r.computed >= len(r.tokens)]
        self.busy = bool(items or decoding)
        if self.busy:
            dt = self.cluster.prices.of(sum(n for _, n in items), len(decoding))
            self.cluster.at(now + dt * self.cluster.jitter(), lambda: self._done(items, decoding))
        elif any(r.ready > now for r in self.waiting):  # loads running: look again after
            self.busy = True
            self.cluster.at(min(r.ready for r in self.waiting if r.ready > now), self._wake)

    def _wake(self) -> None:
        self.busy = False
        self.step()

    def _store(self, r: Request, hashes: list[bytes], pin: bool) -> None:
        """``hashes`` (a run of ``r``'s pages) are in the device pool now; ``pin``: ``r``
        holds them until it ends."""
        new = [h for h in hashes if h not in self.cache]
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
            self.computing.discard(h)
            if pin:
                self.pins[h] = self.pins.get(h, 0) + 1
        if pin:
            r.held += hashes
        self.cluster.event(self.url, "stored", "device", new)
        self.cluster.write(self.url, new)

    def _done(self, items: list[tuple[Request, int]], decoding: list[Request]) -> None:
        for r, n in items:
            r.computed += n
            self._store(r, r.hashes[len(r.held):min(r.computed // PS, len(r.hashes))], True)
            if r.computed >= len(r.tokens):
                r.first = self.cluster.now
                self.cluster.first_token(r)
        for r in decoding:
            r.decoded += 1
            if r.decoded + 1 >= len(r.reply):  # the first token came with the prefill
                self._finish(r)
        self.busy = False
        self.step()

    def _finish(self, r: Request) -> None:
        """Its pages stay cached (the reply's full pages too) and unpinned."""
        self.running.remove(r)
        for h in r.held:
            self.pins[h] -= 1
        full = r.tokens + r.reply
        tail = chain_hashes(full[:len(full) // PS * PS], PS, root_hash(IDENTITY))[len(r.held):]
        if self._room(len(tail)):
            self._store(r, tail, pin=False)
        self.cluster.done(r)


def workload(name: str, seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """``router.py``'s quick shapes, as token ids: per session, each turn's (prompt, reply).
    agent: 5 agents x 3 steps under a 592-token tool prompt, each step adding the call and a
    tool output growing by 24 tokens; chat: 7 users x 3 turns under a 160-token system prompt."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    sessions, reply_len = ((5, 3), 16)
    system, first, growth = text(592), 50, lambda k: 78 + 24 * k
    if name == "chat":
        sessions, system, first, growth = (7, 3), text(160), 48, lambda k: 52
    out = []
    for _ in range(sessions[0]):
        prompt, turns = system + text(first), []
        for k in range(sessions[1]):
            reply = text(reply_len)
            turns.append((prompt, reply))
            prompt = prompt + reply + text(growth(k))
        out.append(turns)
    return out


class Cluster:
    """The router (real policy and index), two modelled workers and the client's loop."""

    def __init__(self, config: str, name: str, seed: int, prices: Prices, jitter: float,
                 concurrency: int = 4) -> None:
        self.now, self.prices, self.concurrency = 0.0, prices, concurrency
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._rng, self._jitter = random.Random(seed + 1), jitter
        policy, args = front_args(config)
        opts = {a[2:].replace("-", "_"): float(v) for a, v in zip(args[::2], args[1::2])}
        waits = opts.pop("pool_wait", 1.0) > 0  # the router's --pool-wait (its length: no limit)
        unknown = set(opts) - {f.name for f in fields(CostWeights)}
        if unknown:
            raise SystemExit(f"{config}: not a cost weight: {sorted(unknown)}")
        self.index = PrefixIndex(clock=lambda: self.now)
        self.policy = Policy("kv" if policy == SINGLE else policy, self.index,
                             replace(CostWeights(), **opts), pool_waits=waits)
        self.waits = PoolWaits(self.index, timeout_s=0.0)  # its bookkeeping; held: retried below
        self.held: list[tuple[Request, Choice, int]] = []  # waiting for the pool, at the router
        self.pool: set[bytes] | None = set() if config.endswith(POOL) else None
        pages = {"agent": 72, "chat": 56}[name]
        urls = ("w0", "w1")
        if policy == SINGLE:  # one worker with both pools
            pages, urls = 2 * pages, ("w0",)
        self.workers = [Worker(u, "both", healthy=True, synced=True, model_identity=IDENTITY,
                               page_size=PS, cache_pages=pages,
                               pool_id="pool" if self.pool is not None else None)
                        for u in urls]
        self.by_url = {w.url: w for w in self.workers}
        for w in self.workers:
            self.index.reset(w.url, {})
        self.models = {w.url: ModelWorker(self, w.url, pages) for w in self.workers}
        self.sessions = workload(name, seed)
        self.turns = [(s, 0) for s in range(len(self.sessions))]  # ready, first come first served
        self.in_flight = 0
        self.records: list[Request] = []

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def jitter(self) -> float:
        return self._rng.lognormvariate(0.0, self._jitter) if self._jitter else 1.0

    def event(self, url: str, kind: str, tier: str, hashes: list[bytes]) -> None:
        if hashes:
            e = [{"type": kind, "tier": tier, "hashes": [h.hex() for h in hashes]}]
            self.at(self.now + EVENT_S, lambda: self.index.apply(url, e))

    def write(self, url: str, hashes: list[bytes]) -> None:
        """Write-through to the shared pool: the worker's L3 events once the pages are in."""
        if self.pool is not None and hashes:
            def written() -> None:
                self.pool.update(hashes)
                self.index.apply(url, [{"type": "stored", "tier": "disk",
                                        "hashes": [h.hex() for h in hashes]}])
                held, self.held = self.held, []
                for r, c, n in held:
                    self._arrive(r, c, n)
            self.at(self.now + EVENT_S + LOAD_S_PER_PAGE * len(hashes), written)

    def _send(self, s: int, k: int) -> None:
        tokens, reply = self.sessions[s][k]
        prompt = RoutedPrompt(parse_request({"prompt": tokens, "max_tokens": len(reply)},
                                            "completion"), tokens)
        c = self.policy.pick(self.workers, prompt)
        w = c.worker
        hashes = prompt.page_hashes(IDENTITY, PS)
        hit = c.overlap.pages + c.overlap.pooled
        r = Request((s, k), tokens, reply, self.now, hashes, worker=w.url,
                    routed=Routed(prompt.pages(PS), prompt.prompt_pages(PS) - hit))
        w.begin(r.routed)
        self.index.add_pending(w.url, hashes)
        self.policy.conversations.record(hashes, w.url)
        self.waits.hold(w.url, hashes[c.awaited_pages - c.awaits:c.awaited_pages])
        self._arrive(r, c, max(c.awaited_pages, self.waits.reach(w.url, hashes)))

    def _arrive(self, r: Request, c: Choice, n: int) -> None:
        """``r`` reaches its worker, or is held at the router until the pool has its first
        ``n`` pages (``pool_wait.py``)."""
        w = c.worker
        if n and not self.index.servable(w.url, [v.url for v in self.workers if v is not w],
                                         r.hashes[:n]):
            self.held.append((r, c, n))
            return
        self.waits.release(w.url, r.hashes[c.awaited_pages - c.awaits:c.awaited_pages])
        w.loads(r.routed, c.awaits)
        self.models[w.url].add(r)

    def _pump(self) -> None:
        while self.turns and self.in_flight < self.concurrency:
            self.in_flight += 1
            self._send(*self.turns.pop(0))

    def first_token(self, r: Request) -> None:
        self.by_url[r.worker].first_token(r.routed)

    def done(self, r: Request) -> None:
        self.by_url[r.worker].end(r.routed)
        self.records.append(r)
        self.in_flight -= 1
        s, k = r.turn
        if k + 1 < len(self.sessions[s]):
            self.turns.append((s, k + 1))
        self._pump()

    def run(self) -> list[Request]:
        self._pump()
        while self._queue:
            self.now, _, fn = heapq.heappop(self._queue)
            fn()
        return self.records


def ttft_p50(records: list[Request]) -> float:
    return statistics.median(r.first - r.arrive for r in records)


def hit_rate(records: list[Request]) -> float:
    return sum(r.hit for r in records) / sum(len(r.tokens) for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="agent,chat")
    ap.add_argument("--configs", default=f"{SINGLE},round_robin,kv,kv/pool")
    ap.add_argument("--runs", type=int, default=40, help="seeds per config (prompts, jitter)")
    ap.add_argument("--jitter", type=float, default=0.25, help="log-normal sigma of step times")
    ap.add_argument("--prices", default=None, help="step,token,decode seconds (default: measure)")
    ap.add_argument("--show", type=int, default=None, help="print this seed's requests")
    args = ap.parse_args()
    prices = Prices(*map(float, args.prices.split(","))) if args.prices else measure_prices()
    print(f"prices: {prices}")
    for name in args.workloads.split(","):
        p50s: dict[str, list[float]] = {}
        for config in args.configs.split(","):
            runs = [Cluster(config, name, seed, prices, args.jitter).run()
                    for seed in range(args.runs)]
            p50s[config] = [ttft_p50(rs) for rs in runs]
            print(f"{name} {config:32s} TTFT p50 {statistics.median(p50s[config]) * 1e3:6.0f} ms"
                  f"  hit rate {statistics.mean(map(hit_rate, runs)):6.1%}")
            if args.show is not None:
                for r in sorted(runs[args.show], key=lambda r: r.arrive):
                    print(f"    session {r.turn[0]} turn {r.turn[1]} on {r.worker} at {r.arrive:6.2f} s: TTFT "
                          f"{(r.first - r.arrive) * 1e3:5.0f} ms, hit {r.hit // PS}/"
                          f"{-(-len(r.tokens) // PS)} pages")
        base = p50s.get("round_robin")
        for config, vals in p50s.items():
            if base and config != "round_robin":
                ratios = sorted(v / b for v, b in zip(vals, base))
                print(f"{name} {config:32s} TTFT p50 / round_robin's, per run: median "
                      f"{statistics.median(ratios):.2f}x, middle 80% [{ratios[len(ratios) // 10]:.2f}, "
                      f"{ratios[-1 - len(ratios) // 10]:.2f}]")


if __name__ == "__main__":
    main()
