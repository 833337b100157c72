"""L3 pages bound to their content (issue 12): swapped, forged and header-flipped files are
never read as the page asked for; bad files heal; dead writers' temp files go at start-up;
every lost write is counted and logged."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import xxhash

from deepinfer.kv.tiers.disk_store import DiskStore
from deepinfer.kv.tiers.disk_file import PREFIX, PageFormat, page_id

NS = "model=abc;codec=lossless;page=4"
REPO = Path(__file__).resolve().parents[3]


def page(i: int):
    return page_id(bytes([i]) * 16, [i, i + 1, i + 2, i + 3])


def key(i: int) -> str:
    return f"{i:02x}" * 16


def path(store: DiskStore, k: str) -> Path:
    return Path(store.path) / k[:2] / f"{k}.kv"


def header_of(data: bytes) -> tuple[dict, int]:
    _, _, hlen = PREFIX.unpack_from(data)
    return json.loads(data[PREFIX.size : PREFIX.size + hlen]), PREFIX.size + hlen


def rewrite(data: bytes, fmt: PageFormat, **fields) -> bytes:
    """The file with header fields changed and a fresh tag (what a forger without the secret
    can do)."""
    header, off = header_of(data)
    header.update(fields)
    h = json.dumps(header, separators=(",", ":")).encode()
    body = PREFIX.pack(b"DIKV", 2, len(h)) + h + data[off : off + header["payload_len"]]
    return body + fmt.tag(body, alg=header["tag_alg"])


def test_a_file_moved_into_another_pages_place_is_a_miss(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, NS)
    assert s.put(key(1), b"A" * 64, 4, page(1)) and s.put(key(2), b"B" * 64, 4, page(2))
    moved = rewrite(path(s, key(2)).read_bytes(), s.format, key=key(1))  # key fixed, tag fixed
    path(s, key(1)).write_bytes(moved)
    assert s.get(key(1), expect=page(1)) is None
    assert s.stats()["mismatched_files"] == 1 and not path(s, key(1)).exists()  # quarantined
    assert s.get(key(2), expect=page(2)) == b"B" * 64
    # the page hash right but the token ids another page's
    other_tokens = page_id(page(3).page_hash, [9, 9, 9, 9])
    assert s.put(key(3), b"C" * 64, 4, other_tokens)
    assert s.get(key(3), expect=page(3)) is None and s.stats()["mismatched_files"] == 2


def test_without_a_secret_a_full_forgery_passes_with_one_it_does_not(tmp_path):
    """What the docs say: the CRC binds a file to its page against accidents, not attackers."""
    plain = DiskStore(tmp_path / "plain", 1 << 20, NS)
    assert plain.put(key(1), b"A" * 64, 4, page(1)) and plain.put(key(2), b"B" * 64, 4, page(2))
    forged = rewrite(path(plain, key(2)).read_bytes(), plain.format, key=key(1),
                     page=page(1).page_hash.hex(), tokens=page(1).tokens_digest.hex())
    path(plain, key(1)).write_bytes(forged)
    assert plain.get(key(1), expect=page(1)) == b"B" * 64  # forged KV is read

    keyed = DiskStore(tmp_path / "keyed", 1 << 20, NS, secret=b"s3cret")
    assert keyed.put(key(1), b"A" * 64, 4, page(1)) and keyed.put(key(2), b"B" * 64, 4, page(2))
    data = path(keyed, key(2)).read_bytes()
    with_crc = rewrite(data, PageFormat(NS), key=key(1), tag_alg="crc32",
                       page=page(1).page_hash.hex(), tokens=page(1).tokens_digest.hex())
    path(keyed, key(1)).write_bytes(with_crc)
    assert keyed.get(key(1), expect=page(1)) is None  # unkeyed: foreign, never read
    wrong_key = rewrite(data, PageFormat(NS, b"guess"), key=key(1),
                        page=page(1).page_hash.hex(), tokens=page(1).tokens_digest.hex())
    path(keyed, key(1)).write_bytes(wrong_key)
    assert keyed.get(key(1), expect=page(1)) is None
    st = keyed.stats()
    assert st["foreign_files"] == 1 and st["checksum_failures"] == 1
    assert keyed.get(key(2), expect=page(2)) == b"B" * 64
    # a store without the secret cannot read keyed files (and does not call them damaged)
    assert DiskStore(tmp_path / "keyed", 1 << 20, NS).get(key(2), expect=page(2)) is None


def test_verify_catches_every_single_byte_header_flip(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, NS)
    assert s.put(key(1), b"P" * 256, 4, page(1))
    good = path(s, key(1)).read_bytes()
    _, off = header_of(good)
    maint = DiskStore(tmp_path, 1 << 40, None)
    for i in range(off):
        bad = bytearray(good)
        bad[i] ^= 0x01
        path(s, key(1)).write_bytes(bytes(bad))
        r = maint.verify()
        assert r["checked"] == 1 and r["ok"] == 0, (i, r)
    path(s, key(1)).write_bytes(good)
    assert maint.verify() == {**maint.verify(), "ok": 1}


def test_verify_reports_and_repair_removes(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, NS)
    for i in range(3):
        assert s.put(key(i), bytes([i]) * 128, 4, page(i))
    data = bytearray(path(s, key(1)).read_bytes())
    data[-10] ^= 0x80
    path(s, key(1)).write_bytes(bytes(data))
    maint = DiskStore(tmp_path, 1 << 40, None)
    assert maint.verify()["checksum_failures"] == 1 and path(s, key(1)).exists()  # a report
    r = maint.verify(repair=True)
    assert r["repaired"] == 1 and not path(s, key(1)).exists()
    assert maint.verify() == {**r, "checksum_failures": 0, "checked": 2, "ok": 2, "repaired": 0}


def test_a_bad_file_heals_when_the_page_is_written_again(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, NS)
    assert s.put(key(1), b"A" * 64, 4, page(1))
    data = bytearray(path(s, key(1)).read_bytes())
    data[40] ^= 0xFF
    path(s, key(1)).write_bytes(bytes(data))
    fresh = DiskStore(tmp_path, 1 << 20, NS)  # a restart: the file is in the index
    assert fresh.get(key(1), expect=page(1)) is None
    assert fresh.put(key(1), b"A" * 64, 4, page(1))  # the recomputed page
    assert DiskStore(tmp_path, 1 << 20, NS).get(key(1), expect=page(1)) == b"A" * 64


def test_temp_files_of_a_killed_writer_are_removed_at_the_next_start(tmp_path):
    """kill -9 during a write (its fsync never returns), then open the directory again."""
    child = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from deepinfer.kv.tiers import disk_store as ds
        ds.os.fsync = lambda fd: time.sleep(3600)  # a disk that never completes the write
        store = ds.DiskStore({str(tmp_path)!r}, 1 << 30, "ns")
        store.put("ab" * 16, os.urandom(1 << 16), 16)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("??/.*.tmp")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(list(tmp_path.glob("??/.*.tmp"))) == 1  # what the kill left
    store = DiskStore(tmp_path, 1 << 30, "ns")  # fresh, far younger than tmp_max_age_s
    assert not list(tmp_path.glob("??/.*.tmp")) and store.stats()["stale_tmp_removed"] == 1


def test_temp_files_of_live_writers_are_kept(tmp_path):
    from deepinfer.kv.tiers import tmp_files

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "ab").mkdir()
        mine = tmp_path / "ab" / f".{'ab' * 16}.{tmp_files._HOST}.{live.pid}.1.tmp"
        other_host = tmp_path / "ab" / f".{'ab' * 16}.elsewhere.1.1.tmp"
        mine.write_bytes(b"x")
        other_host.write_bytes(b"x")
        DiskStore(tmp_path, 1 << 30, "ns")
        assert mine.exists() and other_host.exists()  # alive; another host's: by age only
        DiskStore(tmp_path, 1 << 30, "ns", tmp_max_age_s=-1)
        assert mine.exists() and not other_host.exists()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("err,cause", [(errno.ENOSPC, "no_space"), (errno.EACCES, "permission"),
                                       (errno.EIO, "other")])
def test_every_lost_write_is_counted_and_logged_rate_limited(tmp_path, monkeypatch, caplog,
                                                             err, cause):
    from deepinfer.kv.tiers import disk_store as ds

    s = DiskStore(tmp_path, 1 << 20, NS)

    def fail(fd):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(ds.os, "fsync", fail)
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv.tiers.disk_store"):
        for i in range(3):
            assert not s.put(key(i), b"x" * 64, 4, page(i))
    st = s.stats()
    assert st[f"write_errors_{cause}"] == 3 and st["write_errors"] == 3
    lines = [r for r in caplog.records if f"({cause})" in r.getMessage()]
    assert len(lines) == 1  # the next ones within the interval are counted, not logged
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv.tiers.disk_store"):
        assert not s.put(key(9), b"x" * (1 << 21), 4, page(9))  # larger than the whole store
    assert s.stats()["rejected"] == 1 and "does not fit" in caplog.text


def test_tags_are_over_header_and_payload():
    fmt = PageFormat(NS)
    head = fmt.head(key(1), 4, 4, page(1))
    assert fmt.tag_alg == "xxh3-128"
    assert fmt.tag(head, b"abcd") == xxhash.xxh3_128_digest(head + b"abcd")
    assert fmt.tag(head, b"abcd", alg="crc32") == zlib.crc32(head + b"abcd").to_bytes(4, "little")
    keyed = PageFormat(NS, b"k")
    assert len(keyed.tag(head, b"abcd")) == 32 and keyed.tag(head, b"abcd") != \
        PageFormat(NS, b"j").tag(head, b"abcd")


@pytest.mark.parametrize("ns", [NS, None, 'model "x" \u00e9|codec=fp8'])
@pytest.mark.parametrize("secret", [None, b"k"])
def test_headers_are_the_json_files_always_had(ns, secret):
    """``head`` assembles the header from parts: byte for byte the JSON object it replaced, so
    files written before and after are the same and the native reads' compare holds."""
    fmt = PageFormat(ns, secret)
    for k, n, pid in [(key(1), 16, page(1)), (key(2), 10**6, page_id(b"\1" * 16)), ("odd\"key", 0, None)]:
        header = json.dumps(
            {"namespace": ns, "key": k, "token_count": n, "payload_len": 4096,
             "page": pid.page_hash.hex() if pid else None,
             "tokens": pid.tokens_digest.hex() if pid and pid.tokens_digest else None,
             "tag_alg": fmt.tag_alg}, separators=(",", ":")).encode()  # fmt: skip
        assert fmt.head(k, 4096, n, pid) == PREFIX.pack(b"DIKV", 2, len(header)) + header


def _read_into(s: DiskStore, k: str, n: int, expect) -> bytes | None:
    buf = bytearray(n)
    mv = memoryview(buf)
    return bytes(buf) if s.read_into(k, [mv[: n // 2], mv[n // 2 :]], expect) else None


def test_read_into_takes_one_read_once_it_knows_the_header_length(tmp_path, monkeypatch):
    s = DiskStore(tmp_path, 1 << 20, NS)
    for i in range(1, 4):
        assert s.put(key(i), bytes([i]) * 64, 4, page(i))
    calls: list[str] = []
    for name in ("pread", "preadv", "fstat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    assert _read_into(s, key(1), 64, page(1)) == b"\x01" * 64
    assert calls == ["fstat", "pread", "preadv"]  # the first: header, then the rest
    calls.clear()
    assert _read_into(s, key(2), 64, page(2)) == b"\x02" * 64
    assert _read_into(s, key(3), 64, page(3)) == b"\x03" * 64
    assert calls == ["preadv", "preadv"]  # then one read per file
    assert s.stats()["hits"] == 3


def test_one_read_path_checks_everything_the_two_step_path_does(tmp_path):
    """Once the header length is known, files of other lengths, old CRC-32 files, moved, damaged
    and lengthened files are each read or rejected as before."""
    s = DiskStore(tmp_path, 1 << 20, NS)
    for i in range(1, 8):
        assert s.put(key(i), bytes([i]) * 64, 4, page(i))
    assert _read_into(s, key(1), 64, page(1)) == b"\x01" * 64  # learns the header length
    data = path(s, key(2)).read_bytes()
    path(s, key(2)).write_bytes(rewrite(data, s.format, tag_alg="crc32"))  # an older file
    assert _read_into(s, key(2), 64, page(2)) == b"\x02" * 64
    path(s, key(3)).write_bytes(rewrite(path(s, key(3)).read_bytes(), s.format, token_count=123456))
    assert _read_into(s, key(3), 64, page(3)) == b"\x03" * 64  # a longer header
    moved = rewrite(path(s, key(5)).read_bytes(), s.format, key=key(4))  # same length, other page
    path(s, key(4)).write_bytes(moved)
    assert _read_into(s, key(4), 64, page(4)) is None
    flipped = bytearray(path(s, key(5)).read_bytes())
    flipped[-20] ^= 1  # in the payload
    path(s, key(5)).write_bytes(bytes(flipped))
    assert _read_into(s, key(5), 64, page(5)) is None
    path(s, key(6)).write_bytes(path(s, key(6)).read_bytes() + b"x")  # one byte past the tag
    assert _read_into(s, key(6), 64, page(6)) is None
    assert _read_into(s, key(7), 48, page(7)) is None  # the reader's layout differs
    st = s.stats()
    assert (st["mismatched_files"], st["checksum_failures"], st["corrupt_files"],
            st["foreign_files"], st["hits"]) == (1, 1, 1, 1, 3)
