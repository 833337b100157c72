"""Layer-wise L3 loads (issue 17, ``kv/tiers/layer_stream.py``): a hit's prefill runs while its
pages load layer by layer. Exact (the same KV and tokens as a whole-page load), and a page that
fails its check, or a loader that dies mid-read, leaves nothing half-applied: the request
recomputes from the first page that did not check out."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch
from deepinfer.kv.hashing import chain_hashes
from deepinfer.kv.layout import KVSpec
from deepinfer.kv.pool import PagePool
from deepinfer.kv.radix import DISK
from deepinfer.kv.tiers import layer_stream
from deepinfer.kv.tiers.backend import LoadJob
from deepinfer.kv.tiers.batch_reads import BatchReads, page_reads_kernel
from deepinfer.kv.tiers.disk_file import page_id
from deepinfer.kv.tiers.page_bytes import PoolTransfer
from deepinfer.kv.tiers.tier_io import TierIO
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
PS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("codec", ["lossless", "fp8", "fp4"])
def test_a_streamed_load_lands_what_a_whole_page_load_does(tmp_path, codec, read_path):
    specs = [KVSpec.gqa(2, 32) for _ in range(3)] + [KVSpec.gqa(2, 32, share_with=1)]
    n = 10
    src = PagePool(specs, n + 1, 16, torch.float32, torch.device("cpu"))
    for b in src.owned_buffers():
        b.copy_(torch.randn(b.shape))
    keys = [f"{i:032x}" for i in range(n)]
    ids = [page_id(i.to_bytes(16, "little"), list(range(16))) for i in range(n)]
    w = TierIO(PoolTransfer(src), 16, "t", disk_dir=tmp_path, disk_bytes=1 << 30, disk_codec=codec)
    assert w.device_to_disk(list(range(1, n + 1)), keys, ids) and w.close()
    got = []
    for stream in (False, True):
        dst = PagePool(specs, n + 1, 16, torch.float32, torch.device("cpu"))
        io = TierIO(PoolTransfer(dst), 16, "t", disk_dir=tmp_path, disk_bytes=1 << 30,
                    disk_codec=codec)
        job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=list(ids),
                      dest=list(range(1, n + 1)))
        if stream:
            assert io.stream_layers(job)
        io.start_load(job)
        if stream:
            for layer in range(len(specs)):  # the shared layer waits on its owner's KV
                job.layers.wait(layer)
        while not job.done:
            io.wait(1.0)
        assert job.num_loaded == n
        assert io.stats()["disk_pages_streamed"] == (n if stream else 0)
        got.append([b[1:].clone() for b in dst.owned_buffers()])
        io.close()
    for a, b in zip(*got):
        assert torch.equal(a, b)
    if codec == "lossless":
        for a, b in zip(src.owned_buffers(), got[1]):
            assert torch.equal(a[1:], b)


def make(tiny_llama, disk, **kw):
    return LLM(str(tiny_llama), page_size=PS, num_pages=512, max_num_batched_tokens=256,
               progress=False, host_cache_gb=0, disk_cache_dir=str(disk), **kw)


def prompt(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture()
def on_disk(tiny_llama, tmp_path):
    """A 101-token prompt's 25 full pages written to L3 by an engine that is gone."""
    p = prompt(101, seed=3)
    a = make(tiny_llama, tmp_path)
    a.generate(p, GREEDY)
    hashes = chain_hashes(p, PS, a.engine.kv.root(None))
    files = [Path(a.engine.tiers.store.file_path(a.engine.tiers.disk_key(h))) for h in hashes]
    a.engine.shutdown()
    assert all(f.exists() for f in files)
    return p, files


@pytest.fixture(params=["native", "python"])
def read_path(request, monkeypatch):
    """Streams through the native ``LayerReads`` (where it built) or the per-piece Python reads."""
    if request.param == "python":
        monkeypatch.setattr(BatchReads, "make", staticmethod(lambda *a: None))
    elif not page_reads_kernel().loaded:
        pytest.skip(page_reads_kernel().error)
    return request.param


class GatedReads:
    """A native ``LayerReads`` whose read of layer group ``group`` first calls ``gate``."""

    def __init__(self, reads, group, gate):
        self.reads, self.group, self.gate, self.n = reads, group, gate, 0

    def opened(self):
        return self.reads.opened()

    def read(self, buffers, pages, off):
        if self.n == self.group:
            self.gate()
        self.n += 1
        return self.reads.read(buffers, pages, off)

    def finish(self, touch):
        return self.reads.finish(touch)


@pytest.fixture()
def forward_first(monkeypatch, read_path):
    """Make the streamed read of layer group ``group`` (on the Python path: its read of page
    ``page``; natively: the first slice's read of it) wait until the forward waits for layer 1
    (so the request surely started on the load), then call ``then`` (e.g. raise) or read.
    -> a counter of the reads so gated (one)."""
    reached, lock = threading.Event(), threading.Lock()
    real_for_layer, real_preadv, real_open = ForwardBatch.for_layer, os.preadv, BatchReads.open_layers
    calls = [0]

    def for_layer(batch, i):
        if i == 1 and batch.layer_loads:
            reached.set()
        return real_for_layer(batch, i)

    def gate():
        with lock:
            first, calls[0] = calls[0] == 0, calls[0] + 1
        if first:
            assert reached.wait(30)
            if action[0] is not None:
                action[0]()

    action = [None]

    def setup(group, page=0, then=None, pages=25):
        action[0] = then
        preads = [0]

        def preadv(fd, bufs, off):
            preads[0] += 1
            if preads[0] == group * pages + page + 1:
                gate()
            return real_preadv(fd, bufs, off)

        def open_layers(batch, keys, ids, first):
            reads, sizes = real_open(batch, keys, ids, first)
            return GatedReads(reads, group, gate), sizes

        monkeypatch.setattr(ForwardBatch, "for_layer", for_layer)
        monkeypatch.setattr(layer_stream.os, "preadv", preadv)
        monkeypatch.setattr(BatchReads, "open_layers", open_layers)
        return calls

    return setup


def run(tiny_llama, disk, p, stream, tail=(7, 8, 9)):
    llm = make(tiny_llama, disk, kv_stream_layers=stream)
    out = llm.generate(p + list(tail), GREEDY)[0]
    st = llm.engine.tiers.stats() | llm.engine.stats()
    llm.engine.shutdown()
    return out, st


@pytest.mark.parametrize("tail", [(7, 8, 9), ()])  # (): one token left, run as a decode row
def test_a_streamed_hit_gives_the_tokens_of_a_whole_page_load(tiny_llama, tmp_path, on_disk,
                                                              forward_first, tail):
    p, _ = on_disk
    whole, st_whole = run(tiny_llama, tmp_path, p, stream=False, tail=tail)
    calls = forward_first(group=1)  # layer 1's first read: layer 0 computed meanwhile
    streamed, st = run(tiny_llama, tmp_path, p, stream=True, tail=tail)
    assert st["disk_pages_streamed"] == 25 and st_whole["disk_pages_streamed"] == 0
    assert st["cache_streamed_loads_total"] == 1 and st["cache_streamed_rewinds_total"] == 0
    assert streamed.token_ids == whole.token_ids
    assert streamed.cached_tokens_by_tier == whole.cached_tokens_by_tier == {
        "device": 0, "host": 0, "disk": 100}
    assert streamed.load_bytes_by_tier == whole.load_bytes_by_tier
    assert calls[0] >= 1


def test_a_tail_of_whole_pages_not_on_disk_runs_one_step(tiny_llama, tmp_path, on_disk,
                                                         forward_first):
    """A fresh engine's tree knows no L3 file, so its load probes the prompt's pages to the end;
    the stream takes only the files present, and the tail is computed in the same step (no
    rewind, no step run on pages that were never there)."""
    p, _ = on_disk
    tail = (7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)  # two whole pages and three tokens
    whole, _ = run(tiny_llama, tmp_path, p, stream=False, tail=tail)
    forward_first(group=1)
    streamed, st = run(tiny_llama, tmp_path, p, stream=True, tail=(18, 19, 20, 21, 22, 23, 24, 25, 26))
    cold, _ = run(tiny_llama, tmp_path / "none", p, stream=False, tail=(18, 19, 20, 21, 22, 23, 24, 25, 26))
    assert st["cache_streamed_loads_total"] == 1 and st["cache_streamed_rewinds_total"] == 0
    assert st["disk_pages_streamed"] == 25
    assert streamed.cached_tokens_by_tier == whole.cached_tokens_by_tier == {
        "device": 0, "host": 0, "disk": 100}
    assert streamed.token_ids == cold.token_ids


def test_a_page_failing_its_check_after_the_forward_is_recomputed(tiny_llama, tmp_path, on_disk,
                                                                  forward_first):
    p, files = on_disk
    cold, _ = run(tiny_llama, tmp_path / "none", p, stream=False)
    data = bytearray(files[10].read_bytes())
    data[-20] ^= 0xFF  # the last layer's V of page 10: found only once every layer ran
    files[10].write_bytes(bytes(data))
    calls = forward_first(group=1)
    out, st = run(tiny_llama, tmp_path, p, stream=True)
    assert calls[0] >= 1
    assert out.token_ids == cold.token_ids
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 40}  # pages 0-9
    assert out.num_cached_tokens + out.num_computed_tokens == out.num_prompt_tokens
    assert st["cache_streamed_loads_total"] == st["cache_streamed_rewinds_total"] == 1
    assert st["disk"]["checksum_failures"] == 1  # quarantined, and the recomputed page written
    assert files[10].read_bytes() != bytes(data)


@pytest.mark.parametrize("decode_row", [False, True])
def test_speculation_runs_beside_a_stream_that_rewinds(tiny_llama, tmp_path, on_disk, forward_first, decode_row):
    """Speculative decoding with layer streaming: the streamed step drafts nothing (a page that
    fails its check drops that step's token), the decodes after it draft and verify; with a
    page damaged the request rewinds and the tokens are still the cold ones. ``decode_row``:
    one token after the cached pages, one that occurred earlier (prompt lookup would draft)."""
    p, files = on_disk
    tokens = p[:100] + [p[5]] if decode_row else p + [7, 8, 9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make(tiny_llama, tmp_path / "none", speculative_config=None)
    cold = plain.generate(tokens, params)[0]
    plain.engine.shutdown()
    data = bytearray(files[10].read_bytes())
    data[-20] ^= 0xFF
    files[10].write_bytes(bytes(data))
    calls = forward_first(group=1)
    llm = make(tiny_llama, tmp_path, kv_stream_layers=True, speculative_config=SpeculativeConfig(method="ngram"))
    out = llm.generate(tokens, params)[0]
    st, spec = llm.engine.stats(), llm.engine.spec
    llm.engine.shutdown()
    assert calls[0] >= 1 and spec is not None
    assert st["cache_streamed_loads_total"] == st["cache_streamed_rewinds_total"] == 1
    assert out.token_ids == cold.token_ids
    assert out.cached_tokens_by_tier["disk"] == 40
    assert sum(c.verified for c in spec.totals.values()) > 0


def test_a_loader_dying_mid_read_leaves_nothing_applied(tiny_llama, tmp_path, on_disk,
                                                        forward_first):
    p, _ = on_disk
    cold, _ = run(tiny_llama, tmp_path / "none", p, stream=False)

    def die():
        raise RuntimeError("loader killed")

    calls = forward_first(group=1, page=14, then=die)  # in layer 1, layer 0 in use
    out, st = run(tiny_llama, tmp_path, p, stream=True)
    assert calls[0] >= 1 and st["load_errors"] == 1
    assert st["cache_streamed_loads_total"] == st["cache_streamed_rewinds_total"] == 1
    assert out.token_ids == cold.token_ids
    assert out.cached_tokens_by_tier["disk"] == 0 and out.num_computed_tokens == len(p) + 3


@pytest.mark.parametrize("groups", [0, 1, 2, 5, 30])
def test_native_reads_take_layer_0_alone_then_pieces_of_groups_in_order(groups):
    pieces = layer_stream._pieces(groups)
    assert [g for p in pieces for g in p] == list(range(groups))  # every group once, in order
    assert not pieces or list(pieces[0]) == [0]  # the forward waits on layer 0 alone
    assert all(len(p) <= layer_stream.PIECE_GROUPS for p in pieces)
