"""benchmarks/router_replay.py: the router's real policy and index routing the quick workloads
onto modelled workers. Without jitter a replay is exactly reproducible, every request gets its
first token, the hit rates order as the real benchmark's do (one engine with all the memory,
then kv with the pool, kv, round_robin), kv keeps each chat conversation on one worker (its
stickiness), and with a shared pool the agents' first wave spreads over both idle workers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks"


def _replay(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports router.py by name
    spec = importlib.util.spec_from_file_location("bench_router_replay", BENCH / "router_replay.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_router_replay", mod)
    spec.loader.exec_module(mod)
    return mod


def test_replays_are_reproducible_and_order_the_policies_as_measured(monkeypatch):
    rp = _replay(monkeypatch)
    prices = rp.Prices(step=0.02, token=0.0015, decode=0.003)

    def run(config: str, name: str = "agent"):
        return rp.Cluster(config, name, seed=0, prices=prices, jitter=0.0).run()

    agent = {c: run(c) for c in (rp.SINGLE, "round_robin", "kv", "kv/pool")}
    for records in agent.values():
        assert len(records) == 15 and all(r.first is not None and r.first > r.arrive
                                          for r in records)
    again = run("kv/pool")
    assert [(r.turn, r.worker, r.first) for r in again] == \
        [(r.turn, r.worker, r.first) for r in agent["kv/pool"]]
    hits = [rp.hit_rate(agent[c]) for c in (rp.SINGLE, "kv/pool", "kv", "round_robin")]
    assert hits == sorted(hits, reverse=True) and hits[-1] < hits[2]
    def first_wave(records) -> set[str]:
        return {r.worker for r in records if r.turn[1] == 0 and r.turn[0] < 4}

    # by default a cold start's first wave splits over both workers, the second waiting for the
    # pool to hold the prefix the first computes (one copy); without the wait the duplicate term
    # gathers it on one worker, and without that term on idle workers it splits again (two copies)
    assert first_wave(agent["kv/pool"]) == {"w0", "w1"}
    assert first_wave(run("kv@pool-wait=0/pool")) == {"w0"}
    assert first_wave(run("kv@pool-wait=0+idle-duplicate-weight=0/pool")) == {"w0", "w1"}

    chat = run("kv", "chat")
    homes: dict[int, set[str]] = {}
    for r in chat:
        homes.setdefault(r.turn[0], set()).add(r.worker)
    assert len(chat) == 21 and all(len(h) == 1 for h in homes.values())
    assert rp.hit_rate(chat) > rp.hit_rate(run("round_robin", "chat"))
