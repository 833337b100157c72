"""Hierarchical KV cache through the engine (tiny random Llama): L1 -> L2 -> L3 and back with
identical greedy output, restart and cross-process sharing through L3, fault injection,
kill -9, loads that do not stall other requests, metrics, and the ``deepinfer cache`` CLI."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from deepinfer.cli import main as cli_main
from deepinfer.kv.tiers.disk_file import PageFormat
from deepinfer.kv.tiers.disk_store import DiskStore
from deepinfer.kv.tiers.page_loader import PageLoader
from deepinfer.kv.hashing import chain_hashes
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PS = 4
REPO = Path(__file__).resolve().parents[1]


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


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs with no cache at all, by prompt."""
    llm = make(tiny_llama, enable_prefix_cache=False)
    memo = {}

    def ref(ps):
        missing = [p for p in ps if tuple(p) not in memo]
        for p, o in zip(missing, llm.generate(missing, GREEDY) if missing else []):
            memo[tuple(p)] = o.token_ids
        return [memo[tuple(p)] for p in ps]

    return ref


def page_files(llm, prompt, disk):
    """Paths of the L3 files of ``prompt``'s full pages, in chain order."""
    eng = llm.engine
    hashes = chain_hashes(prompt, PS, eng.kv.root(None))
    keys = [eng.tiers.disk_key(h) for h in hashes]
    return [Path(disk) / k[:2] / f"{k}.kv" for k in keys]


# ------------------------------------------------------------------------------ tiers in one engine


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


# ------------------------------------------------------------------------------ fault injection


def _flip(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2 + 7] ^= 0x40
    f.write_bytes(bytes(data))


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


# ------------------------------------------------------------------------------ scheduling


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
    good = 11 - 11 % PageLoader.READ_CHUNK if eng.tiers.loader.batch else 11
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


# ------------------------------------------------------------------------------ processes

_WORKER = textwrap.dedent("""
    import json, sys
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    ckpt, disk, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    llm = LLM(ckpt, page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False,
              disk_cache_dir=disk)
    res = []
    for p in prompts:
        o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        res.append({"tokens": o.token_ids, "by_tier": o.cached_tokens_by_tier})
    assert llm.engine.shutdown()
    json.dump(res, open(out, "w"))
""")

_HEAVY_WRITER = textwrap.dedent("""
    import sys, torch
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    llm = LLM(sys.argv[1], page_size=4, num_pages=2048, max_num_batched_tokens=2048, progress=False,
              disk_cache_dir=sys.argv[2], host_cache_gb=0)
    g = torch.Generator().manual_seed(0)
    while True:
        ps = [torch.randint(3, 300, (200,), generator=g).tolist() for _ in range(8)]
        llm.generate(ps, SamplingParams(max_tokens=1))
""")


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _spawn(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out


def test_restart_and_processes_sharing_one_l3_dir(tiny_llama, reference, tmp_path):
    """Processes A and C write concurrently (with a common prefix: the same files, raced);
    then this process, B, with an empty tree, hits from L3 everything either wrote, and its
    greedy output is theirs."""
    p1, p3 = prompts(2, 161, seed=40, shared=100)
    disk = tmp_path / "l3"
    a = _spawn(_WORKER, tiny_llama, disk, json.dumps([p1]), tmp_path / "a.json")
    c = _spawn(_WORKER, tiny_llama, disk, json.dumps([p3]), tmp_path / "c.json")
    _finish(a)
    _finish(c)
    ra, rc = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ac")
    # A and C race on the shared prefix: A may hit (a whole-page prefix of) what C wrote so far
    hit = ra[0]["by_tier"]["disk"]
    assert ra[0]["by_tier"]["device"] == 0 and hit % PS == 0 and hit <= 100
    b = make(tiny_llama, disk)
    ob = b.generate(p1, GREEDY)[0]
    assert ob.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 160} and 160 >= len(p1) - PS
    b.engine.kv.evict()
    b.engine.kv.evict(1)  # L1 and L2 emptied: only L3 is left
    ob3 = b.generate(p3, GREEDY)[0]
    assert ob3.cached_tokens_by_tier["disk"] == 160
    assert ra[0]["tokens"] == ob.token_ids == reference([p1])[0]
    assert rc[0]["tokens"] == ob3.token_ids == reference([p3])[0]
    b.engine.shutdown()
    assert DiskStore(disk, 1 << 40, None).verify()["corrupt"] == 0


def test_kill_9_during_heavy_writing_leaves_only_valid_files(tiny_llama, tmp_path):
    proc = _spawn(_HEAVY_WRITER, tiny_llama, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while (len(list(tmp_path.glob("??/*.kv"))) < 300 and time.monotonic() < deadline
               and proc.poll() is None):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out
    report = DiskStore(tmp_path, 1 << 40, None).verify()
    assert report["checked"] >= 300 and report["ok"] == report["checked"], report


# ------------------------------------------------------------------------------ CLI


def test_cache_cli_warm_stats_verify_clear(tiny_llama, tmp_path, capsys):
    disk = tmp_path / "l3"
    system = prompts(1, 64, seed=50)[0]
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text(json.dumps({"prompt_token_ids": system}) + "\n\n" + "plain text prompt line\n")
    args = ["--model", str(tiny_llama), "--page-size", "4", "--num-pages", "512",
            "--disk-cache-dir", str(disk)]
    assert cli_main(["cache", "warm", str(pfile), *args]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["prompts"] == 2 and warm["flushed"] and warm["disk_files"] >= 15
    assert cli_main(["cache", "stats", "--disk-cache-dir", str(disk)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["files"] == warm["disk_files"] and stats["bytes"] > 0
    # a request sharing the warmed system prompt hits it from L3
    llm = make(tiny_llama, disk)
    o = llm.generate(system + prompts(1, 10, seed=51)[0], GREEDY)[0]
    assert o.cached_tokens_by_tier["disk"] == 64
    llm.engine.shutdown()
    _flip(next(disk.glob("??/*.kv")))
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checksum_failures"] == 1 and report["ok"] == report["checked"] - 1
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 1  # only a report
    capsys.readouterr()
    assert cli_main(["cache", "verify", "--repair", "--disk-cache-dir", str(disk)]) == 1
    assert json.loads(capsys.readouterr().out)["repaired"] == 1
    assert cli_main(["cache", "verify", "--disk-cache-dir", str(disk)]) == 0  # quarantined
    capsys.readouterr()
    assert cli_main(["cache", "clear", "--disk-cache-dir", str(disk)]) == 0
    capsys.readouterr()
    assert not list(disk.glob("??/*.kv"))


def test_config_flags_turn_tiers_off(tiny_llama, tmp_path):
    llm = make(tiny_llama, None, host_cache_gb=0)
    assert llm.engine.tiers is None and "cache_pages_by_tier" not in llm.engine.stats()
    with pytest.raises(ValueError, match="cache_policy"):
        make(tiny_llama, tmp_path, cache_policy="sometimes")
    with pytest.raises(ValueError, match="kv_codec_disk"):
        make(tiny_llama, tmp_path, kv_codec_disk="zip")
