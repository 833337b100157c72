"""The direct route's halves in one process (``kv/transfer*.py``): a prefill engine exports a
prompt's pages, a decode engine reads them over Mooncake's transfer engine (loopback TCP) and
loads them through its tier-load path; a bad page is a counted miss and recomputed; ranges are
freed by release, by reads and by TTL. Redis is the store behind both (its copies are what a
bad page falls back to; write-back keeps it empty here)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from store_services import SERVICES

from deepinfer.kv.publish import plan_pages
from deepinfer.kv.transfer import Arena, TransferDescriptor, TransferError, TransferLink
from deepinfer.kv.transfer_export import PageExporter
from deepinfer.kv.transfer_import import PagePuller, StagedPages
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

PS = 4
MB = 1 << 20
pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """(prefill LLM, decode LLM, their links) over one Redis; write-back: nothing reaches the
    store unless evicted, so the decode side's L3 hits can only be the transferred pages."""
    redis = SERVICES["redis"](tmp_path_factory.mktemp("redis")).start()
    kw = dict(page_size=PS, num_pages=256, progress=False, host_cache_gb=0,
              enable_disk_cache=False, cache_policy="write_back", kv_store=redis.url)
    prefill, decode = LLM(str(tiny_llama), **kw), LLM(str(tiny_llama), **kw)
    yield prefill, decode, TransferLink(), TransferLink()
    prefill.engine.shutdown()
    decode.engine.shutdown()
    redis.kill()


def prompt_of(seed: int) -> list[int]:
    return torch.randint(3, 250, (43,), generator=torch.Generator().manual_seed(seed)).tolist()


def export(prefill: LLM, link: TransferLink, prompt: list[int], nbytes: int = 4 * MB,
           ttl_s: float = 60.0) -> tuple[PageExporter, TransferDescriptor | None]:
    eng = prefill.engine
    prefill.generate(prompt, SamplingParams(max_tokens=1, prefill_only=True))
    exporter = PageExporter(eng.kv, eng.tiers, link, nbytes, ttl_s)
    stage = exporter.capture(plan_pages(eng.kv, eng.tiers, prompt, None))
    assert stage is not None
    return exporter, stage("http://127.0.0.1:1/internal/release")


def pull(puller: PagePuller, d: TransferDescriptor, held: int = 0):
    """The pages of ``d`` after the first ``held``, read as the decode worker reads them."""
    return puller.pull(d, puller.manifest(d), held, threading.Event())


def receiver(decode: LLM, link: TransferLink, ttl_s: float = 60.0) -> PagePuller:
    tiers = decode.engine.tiers
    inner = tiers.store
    if isinstance(inner, StagedPages):  # an earlier test's: its buffer goes
        inner.arena.close()
        inner = inner.inner
    staged = StagedPages(inner, tiers.remote.format, Arena(link, 4 * MB), ttl_s)
    tiers.put_in_front(staged)
    return PagePuller(link, staged)


def test_pulled_pages_load_as_l3_hits_and_the_output_is_exact(engines):
    prefill, decode, plink, dlink = engines
    prompt = prompt_of(1)
    exporter, d = export(prefill, plink, prompt)
    assert d is not None and d.pages == 43 // PS and d.session == plink.session
    puller = receiver(decode, dlink)
    staged = puller.staged
    run = pull(puller, d)
    assert len(run.keys) == 10 and staged.stage(run) == 10 and run.held == 0
    assert staged.contains(run.keys[0]) and staged.staged_stats()["staged_pages"] == 10
    got = decode.generate(prompt, GREEDY)[0]
    assert got.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 40}
    assert got.token_ids == prefill.generate(prompt, GREEDY)[0].token_ids
    s = staged.staged_stats()
    assert (s["pages_read"], s["checksum_failures"], s["staged_pages"]) == (10, 0, 0)
    assert staged.arena.free_bytes() == staged.arena.nbytes  # every page read: the run freed
    assert exporter.release(d.transfer_id) and not exporter.release(d.transfer_id)
    assert exporter.arena.free_bytes() == exporter.arena.nbytes
    exporter.close()


def test_a_corrupt_page_is_a_counted_miss_and_is_recomputed(engines):
    prefill, decode, plink, dlink = engines
    prompt = prompt_of(2)
    exporter, d = export(prefill, plink, prompt)
    assert d is not None
    buf = exporter.arena.buffer
    off = d.address - exporter.arena.address + 5 * d.page_bytes + d.page_bytes // 2
    buf[off] ^= 0xFF  # one byte of page 5's payload
    puller = receiver(decode, dlink)
    assert puller.staged.stage(pull(puller, d)) == 10
    got = decode.generate(prompt, GREEDY)[0]
    assert got.cached_tokens_by_tier["disk"] == 5 * PS  # the load stopped at the bad page
    assert got.token_ids == prefill.generate(prompt, GREEDY)[0].token_ids
    assert puller.staged.staged_stats()["checksum_failures"] == 1
    exporter.close()


def test_checksums_unlike_the_descriptors_drop_the_run_and_dead_peers_fail(engines):
    prefill, decode, plink, dlink = engines
    exporter, d = export(prefill, plink, prompt_of(3))
    assert d is not None
    puller = receiver(decode, dlink)
    full = puller.arena.free_bytes()
    wrong = TransferDescriptor(**{**d.to_dict(), "tags": "0" * 32})
    with pytest.raises(TransferError, match="not the ones described"):
        puller.manifest(wrong)
    assert puller.staged.staged_stats()["bad_runs"] == 1
    # pages that are not the manifest's (here: the run shifted by one page)
    shifted = TransferDescriptor(**{**d.to_dict(), "address": d.address + d.page_bytes})
    with pytest.raises(TransferError, match="not the ones described"):
        puller.pull(shifted, puller.manifest(d), 1, threading.Event())
    assert puller.staged.staged_stats()["bad_runs"] == 2
    outside = TransferDescriptor(**{**d.to_dict(), "address": d.address + exporter.arena.nbytes})
    with pytest.raises(TransferError):  # not registered at the peer
        pull(puller, outside)
    gone = TransferDescriptor(**{**d.to_dict(), "session": "127.0.0.1:1"})
    with pytest.raises(TransferError):
        pull(puller, gone)
    abandoned = threading.Event()
    abandoned.set()
    with pytest.raises(TransferError, match="abandoned"):
        puller.pull(d, puller.manifest(d), 0, abandoned)
    assert puller.arena.free_bytes() == full  # no failed pull kept its range
    with pytest.raises(ValueError, match="pages"):
        TransferDescriptor.from_dict({**d.to_dict(), "pages": -1})
    exporter.close()


def test_only_the_pages_after_those_held_cross_the_link(engines):
    """The decode engine served the prompt's first 17 tokens before: its tree holds 4 of the
    10 exported pages, the puller reads only the 6 after them (one read from the 5th page on),
    and the prompt loads 4 pages from L1 and 6 from the pull; none cross if all are held."""
    prefill, decode, plink, dlink = engines
    prompt = prompt_of(5)
    exporter, d = export(prefill, plink, prompt)
    assert d is not None
    plan = plan_pages(prefill.engine.kv, prefill.engine.tiers, prompt, None)
    decode.generate(prompt[:17], GREEDY)
    puller = receiver(decode, dlink)
    m = puller.manifest(d)
    assert m.hashes == plan.hashes[:10] and len(set(m.tags)) == 10
    held = decode.engine.kv.tree.match(m.hashes, touch=False, count_hit=False).num_pages
    assert held == 4
    run = puller.pull(d, m, held, threading.Event())
    assert (run.held, run.keys, run.hashes) == (4, plan.keys[4:10], plan.hashes[4:10])
    assert run.nbytes == 6 * d.page_bytes
    assert puller.staged.stage(run) == 6
    s = puller.staged.staged_stats()
    assert (s["pages_pulled"], s["pages_held"], s["bytes_pulled"]) == (6, 4, 6 * d.page_bytes)
    got = decode.generate(prompt, GREEDY)[0]
    assert got.cached_tokens_by_tier == {"device": 16, "host": 0, "disk": 24}
    assert got.token_ids == prefill.generate(prompt, GREEDY)[0].token_ids
    assert puller.staged.staged_stats()["pages_read"] == 6
    none = puller.pull(d, m, 10, threading.Event())
    assert (none.held, none.keys, none.nbytes) == (10, [], 0) and puller.staged.stage(none) == 0
    assert puller.arena.free_bytes() == puller.arena.nbytes
    assert exporter.release(d.transfer_id)
    exporter.close()


def test_ttls_free_unclaimed_pages_and_a_full_buffer_refuses(engines):
    prefill, decode, plink, dlink = engines
    prompt = prompt_of(4)
    exporter, d = export(prefill, plink, prompt, ttl_s=0.05)
    assert d is not None
    puller = receiver(decode, dlink, ttl_s=0.05)
    run = pull(puller, d, held=4)  # the first 4 pages: the tree has them already
    assert puller.staged.stage(run) == 6
    time.sleep(0.1)
    puller.staged.sweep()
    exporter.sweep()
    assert puller.staged.staged_stats()["expired_pages"] == 6
    assert puller.arena.free_bytes() == puller.arena.nbytes
    assert exporter.stats()["expired"] == 1 and exporter.arena.free_bytes() == exporter.arena.nbytes
    exporter.close()
    small, none = export(prefill, plink, prompt, nbytes=d.page_bytes * 3)
    assert none is None and small.stats()["refused"] == 1
    small.close()
