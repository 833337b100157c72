"""L3 through the engine (issue 12): damaged pages heal after one restart, and a tier that
cannot hold a page says so at start-up and in its counters."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deepinfer.kv.tiers.disk_store import DiskStore
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PS = 4


def make(tiny_llama, disk: Path, **kw) -> LLM:
    args = dict(page_size=PS, num_pages=256, max_num_batched_tokens=256, progress=False,
                host_cache_gb=0, disk_cache_dir=str(disk))
    args.update(kw)
    return LLM(str(tiny_llama), **args)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def flip_every_file(disk: Path) -> int:
    files = list(disk.glob("??/*.kv"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    return len(files)


def run(tiny_llama, disk, p, **kw):
    llm = make(tiny_llama, disk, **kw)
    out = llm.generate(p, GREEDY)[0]
    stats = llm.engine.stats()
    llm.engine.shutdown()
    return out, stats


def test_a_bit_flip_in_every_file_heals_after_one_restart(tiny_llama, tmp_path):
    p = prompt(41, seed=3)  # 10 full pages, 40 tokens a later run can take from L3
    first, _ = run(tiny_llama, tmp_path, p)
    assert flip_every_file(tmp_path) == 11  # the prompt's 10 pages and one of prompt + reply
    second, stats = run(tiny_llama, tmp_path, p)
    assert second.token_ids == first.token_ids and second.num_cached_tokens == 0
    assert stats["cache_checksum_failures_total"] >= 1  # the load stops at the first bad page
    third, _ = run(tiny_llama, tmp_path, p)  # every page was written again
    assert third.token_ids == first.token_ids
    assert third.cached_tokens_by_tier["disk"] == 40
    report = DiskStore(tmp_path, 1 << 40, None).verify()
    assert report["ok"] == report["checked"] == 11


def test_a_keyed_store_reads_only_its_own_files(tiny_llama, tmp_path):
    p = prompt(41, seed=4)
    first, _ = run(tiny_llama, tmp_path, p, kv_store_secret="k1")
    assert run(tiny_llama, tmp_path, p, kv_store_secret="k1")[0].cached_tokens_by_tier["disk"] == 40
    other, stats = run(tiny_llama, tmp_path, p, kv_store_secret="k2")  # without the right key
    assert other.num_cached_tokens == 0 and other.token_ids == first.token_ids
    assert stats["cache_checksum_failures_total"] >= 1


def test_a_tier_with_no_usable_capacity_warns_naming_its_flag(tiny_llama, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv.build"):
        llm = make(tiny_llama, tmp_path, disk_cache_gb=1e-7)  # ~107 bytes: not one page
    assert "--disk-cache-gb" in caplog.text and "no usable capacity" in caplog.text
    assert llm.engine.tiers is None or llm.engine.tiers.disk_capacity == 0
    llm.engine.shutdown()


def test_pages_too_large_for_the_bound_are_counted_by_reason(tiny_llama, tmp_path, caplog):
    one_page = 2 * 2 * 2 * 16 * 4 * PS  # tiny Llama: 2 layers x K,V x 2 heads x 16 dims, fp32
    with caplog.at_level(logging.WARNING):
        llm = make(tiny_llama, tmp_path, disk_cache_gb=3.5 * one_page / 2**30, max_node_pages=8)
        llm.generate(prompt(41, seed=5), GREEDY)
    losses = llm.engine.stats()["cache_disk_write_losses_by_reason_total"]
    llm.engine.shutdown()
    assert losses["too_large"] >= 8 and "larger than the L3 bound" in caplog.text
