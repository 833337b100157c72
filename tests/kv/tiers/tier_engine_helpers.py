"""What the engine-level tier tests share (tiny random Llama, pages of 4 tokens): prompts, an
``LLM`` with the tiers configured, the L3 files of a prompt, hooks on the loader's L3 reads,
the per-tier accounting check, and a byte flip that damages a page file."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.kv.hashing import chain_hashes
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PS = 4


def prompts(n, length, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 300, (shared,), generator=g).tolist()
    return [head + torch.randint(3, 300, (length - shared,), generator=g).tolist() for _ in range(n)]


def make(tiny_llama, disk=None, **kw):
    args = dict(page_size=PS, num_pages=512, max_num_batched_tokens=256, progress=False,
                enable_disk_cache=disk is not None, disk_cache_dir=str(disk) if disk else None)
    args.update(kw)
    return LLM(str(tiny_llama), **args)


def before_reads(eng, hook):
    """Calls ``hook(keys)`` before the engine's loader reads L3 files ``keys``, on both read
    paths: the per-page ``read_into`` and the native batch reads (where the build has them)."""
    store, batch = eng.tiers.store, eng.tiers.loader.batch
    read_into = store.read_into

    def per_page(key, dest, expect=None):
        hook([key])
        return read_into(key, dest, expect)

    store.read_into = per_page
    if batch is not None:
        native = batch._native

        def batched(keys, ids, buffers, pages):
            hook(list(keys))
            return native(keys, ids, buffers, pages)

        batch._native = batched


def host_gb(pages):
    """L2 size in GB holding ``pages`` pages of the tiny model (2 layers x K,V x 2 heads x 16)."""
    return pages * PS * 2 * 2 * 2 * 16 * 4 / 2**30


def tokens(outs):
    return [o.token_ids for o in outs]


def check_accounting(outs):
    for o in outs:
        assert sum(o.cached_tokens_by_tier.values()) == o.num_cached_tokens
        assert o.num_cached_tokens + o.num_computed_tokens == o.num_prompt_tokens


def page_files(llm, prompt, disk):
    """Paths of the L3 files of ``prompt``'s full pages, in chain order."""
    eng = llm.engine
    hashes = chain_hashes(prompt, PS, eng.kv.root(None))
    keys = [eng.tiers.disk_key(h) for h in hashes]
    return [Path(disk) / k[:2] / f"{k}.kv" for k in keys]


def flip(f: Path):
    """Damage a page file: one bit of its payload flipped (its tag no longer matches)."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2 + 7] ^= 0x40
    f.write_bytes(bytes(data))
