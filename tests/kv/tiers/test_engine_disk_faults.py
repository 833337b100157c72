"""L3 faults through the engine: a damaged, truncated, empty or foreign page file, a bad file
the tree still indexes, an unwritable directory and a full disk are counted misses or lost
writes, never a wrong output, and the engine keeps serving."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from tier_engine_helpers import GREEDY, PS, flip, make, page_files, prompts, tokens

from deepinfer.kv.tiers.disk_file import PageFormat


def _flip(f: Path):
    flip(f)  # the test's damage names are its parameter ids


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[:-100])


def _zero(f: Path):
    f.write_bytes(b"")


def _foreign(f: Path):
    """The same key, written for another model: a valid file whose namespace differs."""
    data = f.read_bytes()
    hlen = int.from_bytes(data[6:10], "little")
    header = json.loads(data[10 : 10 + hlen])
    header["namespace"] = "other-model-fingerprint|" + header["namespace"].split("|", 1)[1]
    h = json.dumps(header, separators=(",", ":")).encode()
    body = data[:6] + len(h).to_bytes(4, "little") + h + data[10 + hlen : 10 + hlen + header["payload_len"]]
    f.write_bytes(body + PageFormat(None).tag(body))  # a valid tag: not damaged


@pytest.mark.parametrize("damage,counter", [(_flip, "cache_checksum_failures_total"),
                                            (_truncate, "cache_corrupt_files_total"),
                                            (_zero, "cache_corrupt_files_total"),
                                            (_foreign, "cache_foreign_files_total")])
def test_bad_l3_file_is_a_counted_miss_never_wrong_output(tiny_llama, reference, tmp_path, damage, counter):
    p = prompts(1, 61, seed=20)[0]
    a = make(tiny_llama, tmp_path, host_cache_gb=0)
    a.generate(p, GREEDY)
    a.engine.shutdown()
    files = page_files(a, p, tmp_path)
    damage(files[6])  # page 6 of 15
    b = make(tiny_llama, tmp_path, host_cache_gb=0)
    o = b.generate(p, GREEDY)[0]
    assert o.token_ids == reference([p])[0]
    assert o.cached_tokens_by_tier["disk"] == 6 * PS  # the pages before the bad one
    s = b.engine.stats()
    assert s[counter] == 1
    if damage is not _foreign:  # a broken file is quarantined; a foreign one is left (then replaced)
        assert list((tmp_path / "quarantine").iterdir())
    # serving continues, and the recomputed pages were written again
    o2 = b.generate(prompts(1, 30, seed=21)[0], GREEDY)[0]
    assert len(o2.token_ids) == 12
    b.engine.shutdown()
    c = make(tiny_llama, tmp_path, host_cache_gb=0)
    assert c.generate(p, GREEDY)[0].cached_tokens_by_tier["disk"] == 60
    c.engine.shutdown()


def test_bad_file_known_to_the_tree_is_forgotten(tiny_llama, reference, tmp_path):
    """A page the tree indexes on L3 whose file went bad: counted miss, record dropped."""
    p = prompts(1, 41, seed=22)[0]
    llm = make(tiny_llama, tmp_path, host_cache_gb=0)
    llm.generate(p, GREEDY)
    llm.engine.tiers.flush()
    llm.engine.kv.evict()  # no L2: the tree keeps only the L3 records
    assert llm.engine.kv.tree.pages_in_tier[0] == 0 and llm.engine.kv.tree.pages_in_tier[2] > 0
    _flip(page_files(llm, p, tmp_path)[3])
    o = llm.generate(p, GREEDY)[0]
    assert o.token_ids == reference([p])[0] and o.cached_tokens_by_tier["disk"] == 3 * PS
    s = llm.engine.stats()
    assert s["cache_checksum_failures_total"] == 1 and s["cache_load_failures_total"] == 1
    assert s["cache_stale_disk_records_total"] > 0
    llm.engine.tiers.flush()
    llm.engine.kv.evict()
    assert llm.generate(p, GREEDY)[0].cached_tokens_by_tier["disk"] == 40  # rewritten
    llm.engine.shutdown()


def test_unwritable_dir_serves_correctly(tiny_llama, reference, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    llm = make(tiny_llama, blocker / "kv", host_cache_gb=0)
    ps = prompts(2, 40, seed=23)
    assert tokens(llm.generate(ps, GREEDY)) == reference(ps)
    llm.engine.tiers.flush()
    llm.generate(ps[0], GREEDY)
    s = llm.engine.stats()
    assert s["cache_disk_write_errors_total"] > 0 and s["cache_hit_tokens_by_tier"]["disk"] == 0
    llm.engine.shutdown()


def test_disk_full_serves_correctly(tiny_llama, reference, tmp_path, monkeypatch):
    import deepinfer.kv.tiers.disk_store as ds

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds.os, "fsync", full)
    llm = make(tiny_llama, tmp_path, host_cache_gb=0)
    ps = prompts(2, 40, seed=24)
    assert tokens(llm.generate(ps, GREEDY)) == reference(ps)
    llm.engine.tiers.flush()
    llm.engine.kv.poll()
    s = llm.engine.stats()
    assert s["cache_disk_write_errors_total"] > 0 and s["cache_stale_disk_records_total"] > 0
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # no partial files left
    monkeypatch.undo()
    llm.engine.kv.evict()
    assert tokens(llm.generate(ps, GREEDY)) == reference(ps)  # failed records were forgotten
    llm.engine.shutdown()

