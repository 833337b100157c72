"""Loads from L2/L3 and the schedule: a request waiting on a load does not stall others, a
loader that dies mid-read leaves nothing half applied, an abort mid-load releases everything."""

from __future__ import annotations

import threading
import time

from tier_engine_helpers import GREEDY, PS, before_reads, make, page_files, prompts, tokens

from deepinfer.kv.tiers.page_loader import PageLoader


def test_a_request_waiting_on_a_load_does_not_stall_others(tiny_llama, reference, tmp_path):
    slow, fast = prompts(2, 60, seed=30)
    a = make(tiny_llama, tmp_path)
    a.generate(slow, GREEDY)
    a.engine.shutdown()
    b = make(tiny_llama, tmp_path, host_cache_gb=0)
    eng = b.engine
    gate = threading.Event()
    before_reads(eng, lambda keys: gate.wait(120))  # 120 s: a safety net, the test sets it
    r_slow = eng.add_request(slow, GREEDY)
    r_fast = eng.add_request(fast, GREEDY)
    for _ in range(100):
        eng.step()
        if r_fast.is_finished:
            break
    assert r_fast.is_finished and not r_slow.is_finished and r_slow.num_cached_tokens is None
    gate.set()
    outs = eng.run_to_completion([r_slow, r_fast])
    assert tokens(outs) == reference([slow, fast])
    assert outs[0].cached_tokens_by_tier["disk"] == 56 and outs[1].num_cached_tokens == 0
    eng.shutdown()


def test_a_loader_killed_mid_read_leaves_nothing_half_applied(tiny_llama, reference, tmp_path):
    p = prompts(1, 120, seed=32)[0]  # 29 full pages looked up
    a = make(tiny_llama, tmp_path)
    a.generate(p, GREEDY)
    a.engine.shutdown()
    b = make(tiny_llama, tmp_path, host_cache_gb=0)
    eng = b.engine
    keys = [f.name[:-3] for f in page_files(b, p, tmp_path)]

    def dies(read_keys):
        if keys[11] in read_keys:
            raise RuntimeError("loader killed mid-read")

    before_reads(eng, dies)
    out = b.generate(p, GREEDY)[0]
    # a native batch read dies with its whole chunk: only the chunks before it count
    loader, good = eng.tiers.loader, 11
    if loader.batch:
        good = next(c.start for c in loader.chunks(29, loader.readers_for(keys)) if 11 in c)
    assert out.token_ids == reference([p])[0]
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": good * PS}
    assert out.num_computed_tokens == 120 - good * PS
    kv = eng.kv
    assert not kv._jobs and kv._load_pages == 0
    # every L1 page is free or the tree's: nothing of the dead load is left over
    assert kv.num_free_pages + kv.tree.pages_in_tier[0] == eng.runner.pool.allocator.num_pages - 1
    eng.shutdown()


def test_abort_while_loading_releases_everything(tiny_llama, tmp_path):
    p = prompts(1, 60, seed=31)[0]
    a = make(tiny_llama, tmp_path)
    a.generate(p, GREEDY)
    a.engine.kv.evict()  # to L2
    eng = a.engine
    gate = threading.Event()
    read = eng.tiers.host.read_rows
    eng.tiers.host.read_rows = lambda slots: (gate.wait(120), read(slots))[1]
    r = eng.add_request(p, GREEDY)
    eng.step()
    eng.abort(r.request_id)
    gate.set()
    deadline = time.monotonic() + 120
    while eng.kv.loads_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
        eng.step()  # polls: the orphaned load is dropped once done
    assert not eng.kv.loads_in_flight() and not eng.kv._jobs
    tree = eng.kv.tree
    assert tree.evictable_pages(1) == tree.pages_in_tier[1]  # no lock left behind
    assert a.generate(p, GREEDY)[0].cached_tokens_by_tier["host"] == 56
    eng.shutdown()

