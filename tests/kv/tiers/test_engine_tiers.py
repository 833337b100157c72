"""Hierarchical KV cache through the engine (tiny random Llama): L1 -> L2 -> L3 and back with
identical greedy output, lossy tier codecs, write-back vs write-through, restart through L3,
load measurements, salt isolation, and the config flags that turn the tiers off."""

from __future__ import annotations

import pytest
from tier_engine_helpers import GREEDY, PS, check_accounting, host_gb, make, page_files, prompts, tokens


def test_tiny_l1_spills_to_l2_and_l3_and_comes_back_identical(tiny_llama, reference, tmp_path):
    ps = prompts(8, 40, seed=7, shared=16)
    llm = make(tiny_llama, tmp_path, num_pages=40, max_model_len=128, max_num_seqs=2,
               host_cache_gb=host_gb(40), cache_policy="write_back")
    outs = [llm.generate(p, GREEDY)[0] for p in ps + ps]
    assert tokens(outs) == reference(ps) + reference(ps)
    check_accounting(outs)
    hits = {t: sum(o.cached_tokens_by_tier.get(t, 0) for o in outs[8:]) for t in ("device", "host", "disk")}
    assert hits["host"] > 0 and hits["disk"] > 0, hits
    s = llm.engine.stats()
    assert s["cache_hit_tokens_by_tier"]["host"] == hits["host"] + sum(
        o.cached_tokens_by_tier.get("host", 0) for o in outs[:8])
    assert s["cache_evicted_pages_by_tier"]["device"] > 0 and s["cache_evicted_pages_by_tier"]["host"] > 0
    assert s["cache_bytes_written_by_tier"]["host"] > 0 and s["cache_bytes_read_by_tier"]["disk"] > 0
    assert s["cache_loads_total"] > 0 and s["cache_load_seconds_max"] > 0
    assert s["cache_pages_by_tier"]["host"] <= s["cache_capacity_pages_by_tier"]["host"]
    assert s["prefix_cache_hits"] == sum(s["cache_hit_tokens_by_tier"].values())
    assert llm.engine.shutdown()


@pytest.mark.parametrize("codec", ["fp8", "fp8c", "fp4"])
def test_lossy_tiers_serve_and_account(tiny_llama, tmp_path, codec):
    ps = prompts(4, 40, seed=11)
    llm = make(tiny_llama, tmp_path, kv_codec_host=codec, kv_codec_disk=codec, host_cache_gb=host_gb(64))
    llm.generate(ps, GREEDY)
    llm.engine.kv.evict()  # everything to L2 (and, written through, already on L3)
    again = llm.generate(ps, GREEDY)
    check_accounting(again)
    assert all(o.cached_tokens_by_tier["host"] == 36 and len(o.token_ids) == 12 for o in again)
    assert llm.engine.stats()["cache_bytes_read_by_tier"]["host"] > 0
    llm.engine.tiers.flush()  # the write-through has landed
    fresh = make(tiny_llama, tmp_path, kv_codec_disk=codec, host_cache_gb=0)  # from L3
    o = fresh.generate(ps, GREEDY)
    assert all(x.cached_tokens_by_tier["disk"] == 36 for x in o)
    page = llm.engine.tiers.disk_page_nbytes
    # vs 2 x 2048 B lossless; fp8c's mean and exact token weigh a lot on pages of 4 tokens
    assert page < {"fp8": 0.3, "fp8c": 0.7, "fp4": 0.16}[codec] * 2048 * 2
    for e in (llm, fresh):
        e.engine.shutdown()


def test_write_back_keeps_disk_untouched_until_l2_overflows(tiny_llama, tmp_path):
    llm = make(tiny_llama, tmp_path, cache_policy="write_back")
    llm.generate(prompts(2, 40, seed=3), GREEDY)
    llm.engine.shutdown()
    assert not list(tmp_path.glob("??/*.kv"))
    wt = make(tiny_llama, tmp_path / "wt")  # write_through (the default): on disk at once
    p = prompts(1, 41, seed=3)[0]
    out = wt.generate(p, GREEDY)[0]
    wt.engine.shutdown()
    files = page_files(wt, p + out.token_ids[:11], tmp_path / "wt")  # prompt and reply pages
    assert len(files) == 13 and all(f.exists() for f in files)


def test_restart_in_process_hits_l3_with_empty_tree(tiny_llama, reference, tmp_path):
    p = prompts(1, 101, seed=12)[0]
    a = make(tiny_llama, tmp_path)
    out_a = a.generate(p, GREEDY)[0]
    a.engine.shutdown()
    b = make(tiny_llama, tmp_path, host_cache_gb=0)
    out_b = b.generate(p, GREEDY)[0]
    assert out_b.cached_tokens_by_tier["disk"] == 100 >= len(p) - PS
    assert out_a.token_ids == out_b.token_ids == reference([p])[0]
    # a longer prompt continuing the first turn (prompt + reply) hits it all from L3
    turn2 = p + out_a.token_ids + prompts(1, 9, seed=13)[0]
    c = make(tiny_llama, tmp_path)
    o = c.generate(turn2, GREEDY)[0]
    assert o.cached_tokens_by_tier["disk"] == (len(p) + len(out_a.token_ids) - 1) // PS * PS
    assert o.token_ids == reference([turn2])[0]
    for e in (b, c):
        e.engine.shutdown()


def test_a_load_is_measured_per_request_and_in_the_engine_stats(tiny_llama, tmp_path):
    from deepinfer.cli import _cache_line

    p = prompts(1, 101, seed=15)[0]
    a = make(tiny_llama, tmp_path)
    first = a.generate(p, GREEDY)[0]
    assert first.load_seconds == 0 and first.load_bytes_by_tier == {}
    a.engine.shutdown()
    b = make(tiny_llama, tmp_path, host_cache_gb=0)
    out = b.generate(p, GREEDY)[0]
    page = b.engine.tiers.disk_page_nbytes
    assert out.load_bytes_by_tier == {"host": 0, "disk": 25 * page}
    assert out.load_seconds >= out.load_seconds_by_tier["disk"] > 0
    assert out.load_gb_per_s == pytest.approx(25 * page / out.load_seconds / 1e9)
    st = b.engine.stats()
    assert st["cache_load_bytes_by_tier"] == {"host": 0, "disk": 25 * page}
    assert st["cache_load_read_seconds_by_tier"]["disk"] == out.load_seconds_by_tier["disk"]
    line = _cache_line(out)
    assert f"disk {25 * page / 1e6:.1f} MB in" in line and "GB/s" in line
    b.engine.shutdown()


def test_cache_salt_isolates_l3(tiny_llama, tmp_path):
    p = prompts(1, 40, seed=14)[0]
    a = make(tiny_llama, tmp_path)
    a.generate(p, GREEDY, cache_salt="tenant-a")
    a.engine.shutdown()
    b = make(tiny_llama, tmp_path)
    o = b.generate(p, GREEDY, cache_salt="tenant-b")[0]
    assert o.num_cached_tokens == 0  # another tenant's pages are other files
    o = b.generate(p, GREEDY, cache_salt="tenant-a")[0]
    assert o.cached_tokens_by_tier["disk"] == 36
    b.engine.shutdown()



def test_config_flags_turn_tiers_off(tiny_llama, tmp_path):
    llm = make(tiny_llama, None, host_cache_gb=0)
    assert llm.engine.tiers is None and "cache_pages_by_tier" not in llm.engine.stats()
    with pytest.raises(ValueError, match="cache_policy"):
        make(tiny_llama, tmp_path, cache_policy="sometimes")
    with pytest.raises(ValueError, match="kv_codec_disk"):
        make(tiny_llama, tmp_path, kv_codec_disk="zip")
