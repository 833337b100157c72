"""Router options: the workers, the routing policy and its weights, the address.

Kept free of FastAPI/uvicorn imports so the CLI can build its parser cheaply.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

POLICIES = ("kv", "round_robin", "least_load")


@dataclass
class RouterConfig:
    workers: list[str] = field(default_factory=list)  # serve both prefill and decode
    prefill_workers: list[str] = field(default_factory=list)  # PD: prompts computed here...
    decode_workers: list[str] = field(default_factory=list)  # ...then generated here
    policy: str = "kv"
    # Cost of a worker for a request (``policy.py``): overlap_weight x the prompt pages it would
    # prefill + the pages its open requests still prefill + decode_weight x those decoding
    # + evict_weight x the cached pages the request would push out of its device pool.
    overlap_weight: float = 1.0
    decode_weight: float = 1.0
    evict_weight: float = 1.0
    # A conversation's next turn stays on the worker holding it unless that worker has more than
    # this many pages of open work beyond the least loaded one (``conversations.py``; negative:
    # never, the cost alone decides).
    stick_gap: float = 16.0
    # Workers sharing one KV pool (--kv-store): each page the request would compute that a peer
    # holds or is computing, not yet in the pool, costs this more on a worker with open
    # requests, and idle_duplicate_weight more on one without (its copy delays no other
    # request; ``policy.py``).
    duplicate_weight: float = 1.0
    idle_duplicate_weight: float = 1.0
    pool_weight: float = 0.1  # ... and each page it would load from the pool costs this
    # ... or the request waits for such pages in the pool, held at the router (then loads them)
    # up to this many seconds, where that costs less than computing them (0: never waits)
    pool_wait_s: float = 10.0
    pending_ttl_s: float = 30.0  # how long a routed request's pages count before an event
    worker_api_key: str | None = None  # sent on the router's own calls (KV events, snapshots)
    model: str | None = None  # the workers' model (tokenizer + chat template); None: default
    chat_template: str | None = None  # the workers' --chat-template, if they use one
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0
    events_wait_s: float = 5.0  # long-poll duration of GET /kv/events
    request_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.workers = [u.rstrip("/") for u in self.workers]
        self.prefill_workers = [u.rstrip("/") for u in self.prefill_workers]
        self.decode_workers = [u.rstrip("/") for u in self.decode_workers]
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError("give both --prefill-worker and --decode-worker (or neither)")
        if not self.workers and not self.prefill_workers:
            raise ValueError("give at least one --worker URL (or --prefill-worker and "
                             "--decode-worker)")
        if self.workers and self.prefill_workers:
            raise ValueError("--worker cannot be combined with --prefill-worker/--decode-worker")
        every = self.all_workers
        if len(set(every)) != len(every):
            raise ValueError("a worker URL is given twice")
        for name, v in (("overlap_weight", self.overlap_weight),
                        ("decode_weight", self.decode_weight),
                        ("evict_weight", self.evict_weight),
                        ("duplicate_weight", self.duplicate_weight),
                        ("idle_duplicate_weight", self.idle_duplicate_weight),
                        ("pool_weight", self.pool_weight),
                        ("pool_wait_s", self.pool_wait_s),
                        ("pending_ttl_s", self.pending_ttl_s)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    @property
    def all_workers(self) -> list[str]:
        return self.workers + self.prefill_workers + self.decode_workers

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers)


def add_router_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig  # the class attributes are the fields' defaults
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a `deepinfer serve` worker (repeat for each)")
    p.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                   help="PD: a worker started with --role prefill (repeat for each)")
    p.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                   help="PD: a worker started with --role decode (repeat for each)")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="kv: least prefill + load cost from the workers' KV events (default)")
    p.add_argument("--overlap-weight", type=float, default=d.overlap_weight,
                   help="kv cost = this x pages to prefill + the pages the worker's open "
                        "requests still prefill + --decode-weight x those decoding")
    p.add_argument("--decode-weight", type=float, default=d.decode_weight,
                   help="pages-worth of work the kv cost counts per request decoding")
    p.add_argument("--evict-weight", type=float, default=d.evict_weight,
                   help="kv cost per cached page the request would push out of a worker's "
                        "device pool (the pages it adds beyond the free ones)")
    p.add_argument("--stick-gap", type=float, default=d.stick_gap,
                   help="a conversation's next turn stays on the worker that holds it unless that "
                        "worker has more than this many pages of open work beyond the least "
                        "loaded one (then the kv cost decides; negative: no stickiness)")
    p.add_argument("--duplicate-weight", type=float, default=d.duplicate_weight,
                   help="workers sharing a KV pool (--kv-store): kv cost per page the request "
                        "would compute that another of them holds or is computing and has not "
                        "written to the pool yet (pages already there count as hits), on a "
                        "worker with open requests")
    p.add_argument("--idle-duplicate-weight", type=float, default=d.idle_duplicate_weight,
                   help="the same on a worker with no open request (default 1: gather on the "
                        "peer computing the pages, as on a busy one; 0: its copy delays no other "
                        "request, so the request goes where its first token comes sooner, at the "
                        "price of a second computed copy)")
    p.add_argument("--pool-weight", type=float, default=d.pool_weight,
                   help="workers sharing a KV pool: kv cost per page the request would load "
                        "from the pool instead of computing it (a computed page costs 1)")
    p.add_argument("--pool-wait", type=float, default=d.pool_wait_s,
                   help="workers sharing a KV pool: seconds a request may be held until the "
                        "pool has the pages another of them is computing, to load them instead "
                        "of computing a second copy, where the kv cost of that wait is lower "
                        "(0: never held)")
    p.add_argument("--pending-ttl", type=float, default=d.pending_ttl_s,
                   help="seconds a routed request's pages count as on its worker before the "
                        "worker's KV events confirm them")
    p.add_argument("--worker-api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="the workers' --api-key, sent on KV event polls and snapshots "
                        "(default: $DEEPINFER_API_KEY, the variable `deepinfer serve` reads); "
                        "clients' own keys are passed through on their requests")
    p.add_argument("--model", default=None,
                   help="the workers' model path (its tokenizer and chat template hash prompts "
                        "as the workers do; default: the built-in model)")
    p.add_argument("--chat-template", default=None,
                   help="the workers' --chat-template (file or text), if they use one")
    p.add_argument("--host", default=d.host, help="address to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--health-interval", type=float, default=d.health_interval_s,
                   help="seconds between health checks of each worker")
    p.add_argument("--log-level", default=d.log_level)


def router_config(args: argparse.Namespace) -> RouterConfig:
    from ..server.config import read_chat_template

    return RouterConfig(workers=args.worker, prefill_workers=args.prefill_worker,
                        decode_workers=args.decode_worker, policy=args.policy,
                        overlap_weight=args.overlap_weight, decode_weight=args.decode_weight,
                        evict_weight=args.evict_weight, stick_gap=args.stick_gap,
                        duplicate_weight=args.duplicate_weight,
                        idle_duplicate_weight=args.idle_duplicate_weight,
                        pool_weight=args.pool_weight, pool_wait_s=args.pool_wait,
                        pending_ttl_s=args.pending_ttl,
                        worker_api_key=args.worker_api_key or None, model=args.model,
                        chat_template=read_chat_template(args.chat_template), host=args.host,
                        port=args.port, health_interval_s=args.health_interval,
                        log_level=args.log_level)
