"""L3 disk store: format checks, quarantine, atomicity, failure tolerance, LRU, sharing, async writer."""

from __future__ import annotations

import errno
import hashlib
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

from deepinfer.kv.tiers.disk_store import DiskStore

NS = "model=abc123;layers=30;codec=fp8-b32;page=16"
REPO = Path(__file__).resolve().parents[3]


def key(i: int | str) -> str:
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def kv_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*.kv"))


def visible_non_kv(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "quarantine" not in p.parts and p.suffix != ".kv"]


@pytest.fixture
def store(tmp_path: Path) -> DiskStore:
    return DiskStore(tmp_path / "cache", 1 << 20, NS)


def test_put_get_roundtrip(store: DiskStore) -> None:
    payload = os.urandom(4096)
    assert not store.contains(key(1))
    assert store.get(key(1)) is None
    assert store.put(key(1), payload, token_count=16)
    assert store.contains(key(1))
    assert store.get(key(1)) == payload
    path = Path(store.path) / key(1)[:2] / f"{key(1)}.kv"
    assert path.is_file() and path.read_bytes()[:4] == b"DIKV"
    s = store.stats()
    assert (s["entries"], s["hits"], s["misses"]) == (1, 1, 1)
    assert s["bytes"] == path.stat().st_size == s["bytes_written"]
    assert s["bytes_read"] == 4096
    assert store.put(key(1), payload, 16)  # written again: an existing file may be bad
    assert store.stats()["writes"] == 2 and store.stats()["entries"] == 1


def test_empty_payload_and_bad_keys(store: DiskStore) -> None:
    assert store.put(key(2), b"", 0) and store.get(key(2)) == b""
    for bad in ["../etc", "ABCDEF", "x", "", "0g"]:
        with pytest.raises(ValueError):
            store.put(bad, b"x", 1)


def _file(store: DiskStore, k: str) -> Path:
    return Path(store.path) / k[:2] / f"{k}.kv"


def _assert_rejected(store: DiskStore, k: str, counter: str) -> None:
    assert store.get(k) is None
    assert store.stats()[counter] == 1
    assert not _file(store, k).exists()
    assert list((Path(store.path) / "quarantine").iterdir())
    assert not store.contains(k) and store.stats()["entries"] == 0


def test_flipped_payload_byte_is_quarantined(store: DiskStore) -> None:
    store.put(key(3), os.urandom(1000), 16)
    f = _file(store, key(3))
    data = bytearray(f.read_bytes())
    data[-10] ^= 0x01
    f.write_bytes(bytes(data))
    _assert_rejected(store, key(3), "checksum_failures")


def test_truncated_file(store: DiskStore) -> None:
    store.put(key(4), os.urandom(1000), 16)
    f = _file(store, key(4))
    f.write_bytes(f.read_bytes()[:-100])
    _assert_rejected(store, key(4), "corrupt_files")


def test_zero_length_file(store: DiskStore) -> None:
    store.put(key(5), os.urandom(100), 16)
    _file(store, key(5)).write_bytes(b"")
    _assert_rejected(store, key(5), "corrupt_files")


@pytest.mark.parametrize("mangle", ["magic", "header", "key"])
def test_bad_header(store: DiskStore, mangle: str) -> None:
    k = key(6)
    store.put(k, os.urandom(100), 16)
    f = _file(store, k)
    data = f.read_bytes()
    if mangle == "magic":
        data = b"XXXX" + data[4:]
    elif mangle == "header":
        data = data[:12] + b"\xff" + data[13:]
    else:  # a valid file, but for another key (e.g. a misplaced copy)
        data = data.replace(k.encode(), key(7).encode())
    f.write_bytes(data)
    _assert_rejected(store, k, "corrupt_files")


def test_wrong_namespace_is_a_miss_left_in_place(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, 1 << 20, "model-A")
    b = DiskStore(tmp_path, 1 << 20, "model-B")
    assert a.put(key(8), b"from A", 1)
    assert b.get(key(8)) is None
    assert b.stats()["foreign_files"] == 1 and b.stats()["misses"] == 1
    assert a.get(key(8)) == b"from A"  # still valid for its own namespace
    # A put from B with the same key replaces the foreign file instead of skipping it.
    assert b.put(key(8), b"from B", 1) and b.get(key(8)) == b"from B"


def test_unwritable_dir_put_returns_false(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"not a directory")
    s = DiskStore(blocker / "cache", 1 << 20, NS)  # tests run as root: chmod would not stop us
    assert s.put(key(9), b"x" * 100, 1) is False
    assert s.stats()["write_errors"] == 1
    assert s.get(key(9)) is None and not s.contains(key(9))
    assert s.verify()["checked"] == 0


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_disk_full_leaves_nothing_visible(store: DiskStore, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    def enospc(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, where, enospc)
    assert store.put(key(10), os.urandom(1000), 16) is False
    monkeypatch.undo()
    root = Path(store.path)
    assert kv_files(root) == [] and visible_non_kv(root) == []  # temp file removed too
    assert store.stats()["write_errors"] == 1 and store.stats()["entries"] == 0
    assert store.get(key(10)) is None
    assert store.put(key(10), b"later", 1) and store.get(key(10)) == b"later"  # recovers


def test_capacity_lru_eviction(tmp_path: Path) -> None:
    probe = DiskStore(tmp_path / "probe", 1 << 20, NS)
    probe.put(key(0), bytes(1000), 1)
    file_size = probe.stats()["bytes"]
    s = DiskStore(tmp_path / "c", 3 * file_size, NS)
    for i in range(3):
        assert s.put(key(i), bytes(1000), 1)
    assert s.get(key(0)) is not None  # 0 is now most recent; 1 is the LRU
    assert s.put(key(3), bytes(1000), 1)
    assert not s.contains(key(1)) and not _file(s, key(1)).exists()
    assert all(s.contains(key(i)) for i in (0, 2, 3))
    assert s.stats()["evictions"] == 1 and s.stats()["bytes"] <= 3 * file_size
    s.put(key(4), bytes(1000), 1)
    assert not s.contains(key(2))  # next LRU
    assert s.put(key(5), bytes(10 * file_size), 1) is False  # can never fit
    assert s.stats()["rejected"] == 1
    # Reopen: index rebuilt from one scan (mtime order), bound kept.
    s2 = DiskStore(tmp_path / "c", 2 * file_size, NS)
    assert s2.stats()["entries"] == 2 and len(kv_files(tmp_path / "c")) == 2


def test_eviction_tolerates_files_removed_by_others(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 10_000, NS)
    for i in range(5):
        s.put(key(i), bytes(1000), 1)
    for f in kv_files(tmp_path):
        f.unlink()  # another process evicted everything
    for i in range(5, 20):
        assert s.put(key(i), bytes(1000), 1)
    assert s.stats()["bytes"] <= 10_000


def test_two_instances_share_a_directory(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, 1 << 20, NS)
    b = DiskStore(tmp_path, 1 << 20, NS)  # opened before A writes: its index is empty
    assert a.put(key(11), b"shared", 3)
    assert b.contains(key(11)) and b.get(key(11)) == b"shared"
    assert b.put(key(11), b"shared", 3) and b.stats()["writes"] == 1  # rewritten, atomically
    assert a.get(key(11)) == b"shared"
    a.put(key(12), b"gone soon", 3)
    assert b.get(key(12)) == b"gone soon"
    a.clear()
    assert not b.contains(key(12)) and b.get(key(12)) is None


def test_stale_temp_files_ignored_and_cleaned(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1 << 20, NS)
    s.put(key(13), b"ok", 1)
    tmp = tmp_path / key(13)[:2] / f".{key(14)}.99999.1.tmp"
    tmp.write_bytes(b"DIKV partial")
    assert s.get(key(14)) is None and not s.contains(key(14))
    DiskStore(tmp_path, 1 << 20, NS)  # fresh temp: a live writer may own it
    assert tmp.exists()
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    s2 = DiskStore(tmp_path, 1 << 20, NS, tmp_max_age_s=600)
    assert not tmp.exists() and s2.stats()["entries"] == 1


def test_verify_and_clear(store: DiskStore) -> None:
    for i in range(5):
        store.put(key(i), os.urandom(500), 16)
    f = _file(store, key(2))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    report = store.verify()
    assert report["checked"] == 5 and report["ok"] == 4 and report["checksum_failures"] == 1
    assert store.stats()["entries"] == 4
    store.clear()
    assert kv_files(Path(store.path)) == [] and store.stats()["entries"] == 0
    assert store.verify()["checked"] == 0


def test_closed_store_raises(store: DiskStore) -> None:
    store.close()
    store.close()
    with pytest.raises(RuntimeError):
        store.put(key(1), b"x", 1)


_WRITER = textwrap.dedent(
    """
    import os, sys
    from deepinfer.kv.tiers.disk_store import DiskStore
    s = DiskStore(sys.argv[1], 1 << 40, sys.argv[2])
    i = 0
    while True:
        s.put("%032x" % i, os.urandom(256 * 1024), 16)
        i += 1
    """
)


def test_kill_9_mid_write_leaves_only_valid_files(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), NS], env=env)
    try:
        deadline = time.monotonic() + 300  # importing deepinfer (torch) can take long on a busy box
        while len(kv_files(tmp_path)) < 40 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    n = len(kv_files(tmp_path))
    assert n >= 1
    s = DiskStore(tmp_path, 1 << 40, NS, tmp_max_age_s=0)  # also sweeps the dead writer's temp file
    report = s.verify()
    assert report["checked"] == report["ok"] == n and report["corrupt"] == report["checksum_failures"] == 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_concurrent_threads_put_get(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 200_000, NS)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(60):
                k = key(f"{t}-{i % 20}")
                s.put(k, k.encode() * 10, 1)
                got = s.get(k)
                assert got is None or got == k.encode() * 10
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = s.stats()
    assert st["checksum_failures"] == st["corrupt_files"] == 0
    assert st["bytes"] == sum(f.stat().st_size for f in kv_files(tmp_path)) <= 200_000


def _split(buf: bytearray, sizes: list[int]) -> list[memoryview]:
    mv, out, off = memoryview(buf), [], 0
    for n in sizes:
        out.append(mv[off : off + n])
        off += n
    return out


def test_read_into_fills_the_callers_buffers_and_checks_them_there(store: DiskStore) -> None:
    payload = os.urandom(3 * 4096 + 100)
    assert store.put(key(1), payload, 16)
    header = json.loads(Path(store.path, key(1)[:2], f"{key(1)}.kv").read_bytes()[10:].split(b"}")[0] + b"}")
    assert header["tag_alg"] == "xxh3-128"
    buf = bytearray(len(payload))
    assert store.read_into(key(1), _split(buf, [4096, 4096, 4196]))  # in pieces, like L1 buffers
    assert bytes(buf) == payload
    assert not store.read_into(key(1), _split(bytearray(len(payload) + 1), [len(payload) + 1]))
    assert not store.read_into(key(2), _split(bytearray(8), [8]))  # absent
    s = store.stats()
    assert (s["hits"], s["misses"], s["bytes_read"]) == (1, 2, len(payload))
    # a damaged payload is caught in the caller's buffers, counted and quarantined
    path = Path(store.path, key(1)[:2], f"{key(1)}.kv")
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))
    assert not store.read_into(key(1), _split(buf, [len(payload)]))
    assert store.stats()["checksum_failures"] == 1 and not path.exists()
