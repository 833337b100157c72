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
    run = puller.pull(d, threading.Event())
    assert len(run.keys) == 10 and staged.stage(run, 0) == 10
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
    assert puller.staged.stage(puller.pull(d, threading.Event()), 0) == 10
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
        puller.pull(wrong, threading.Event())
    assert puller.staged.staged_stats()["bad_runs"] == 1
    outside = TransferDescriptor(**{**d.to_dict(), "address": d.address + exporter.arena.nbytes})
    with pytest.raises(TransferError):  # not registered at the peer
        puller.pull(outside, threading.Event())
    gone = TransferDescriptor(**{**d.to_dict(), "session": "127.0.0.1:1"})
    with pytest.raises(TransferError):
        puller.pull(gone, threading.Event())
    abandoned = threading.Event()
    abandoned.set()
    with pytest.raises(TransferError, match="abandoned"):
        puller.pull(d, abandoned)
    assert puller.arena.free_bytes() == full  # no failed pull kept its range
    with pytest.raises(ValueError, match="pages"):
        TransferDescriptor.from_dict({**d.to_dict(), "pages": -1})
    exporter.close()


def test_ttls_free_unclaimed_pages_and_a_full_buffer_refuses(engines):
    prefill, decode, plink, dlink = engines
    prompt = prompt_of(4)
    exporter, d = export(prefill, plink, prompt, ttl_s=0.05)
    assert d is not None
    puller = receiver(decode, dlink, ttl_s=0.05)
    run = puller.pull(d, threading.Event())
    assert puller.staged.stage(run, 4) == 6  # the first 4 pages: the tree has them already
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
