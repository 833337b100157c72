"""The L3 directory on disk: which names it holds and the file operations on them.

Layout: ``<dir>/<key[:2]>/<key>.kv`` (fan-out keeps directories small), writes in progress as
temp files next to their page file (``tmp_files.py``), bad files moved to ``<dir>/quarantine/``.
Here: key checks, paths, the scan of the page files, the atomic write, the quarantine and the
clearing of a directory. No index, no counters, no logging: ``DiskStore`` (``disk_store.py``)
keeps those and decides when each operation runs.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence

from .tmp_files import stale_tmp, tmp_name

_KEY_RE = re.compile(r"[0-9a-f]{2,256}")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")
_QUARANTINE = "quarantine"


def check_key(key: str) -> None:
    """A key names a file under the directory, nothing else."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"disk store keys are 2-256 lowercase hex chars, got {key!r}")


def page_path(root: str, key: str) -> str:
    """The file of page ``key`` (checked) under ``root`` (a load builds one per page it reads:
    a format string, not ``os.path.join``, which cost more than the check)."""
    check_key(key)
    return f"{root}/{key[:2]}/{key}.kv"


def fanout_dirs(root: str) -> list[os.DirEntry[str]]:
    with os.scandir(root) as it:
        return [d for d in it if _FANOUT_RE.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]


def page_keys(fanout: str) -> Iterator[str]:
    """The keys of the page files in one fan-out directory (none if it is gone)."""
    for name in listdir_quiet(fanout):
        key = name[:-3]
        if name.endswith(".kv") and _KEY_RE.fullmatch(key):
            yield key


def scan(root: str, tmp_max_age_s: float) -> tuple[list[tuple[float, str, int]], int]:
    """The page files (mtime, key, size), oldest first, and how many stale temp files (dead
    or old writers', ``tmp_files.py``) were removed on the way."""
    now = time.time()
    found: list[tuple[float, str, int]] = []
    stale = 0
    for d in fanout_dirs(root):
        try:
            entries = list(os.scandir(d.path))
        except OSError:
            continue  # removed under us
        for f in entries:
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            if f.name.endswith(".kv") and _KEY_RE.fullmatch(f.name[:-3]):
                found.append((st.st_mtime, f.name[:-3], st.st_size))
            elif f.name.endswith(".tmp") and stale_tmp(f.name, now - st.st_mtime, tmp_max_age_s):
                unlink_quiet(f.path)
                stale += 1
    found.sort()
    return found, stale


def write_atomic(final: str, key: str, parts: Sequence[bytes]) -> None:
    """Write ``parts`` to a temp file next to ``final``, fsync it, rename it into place: readers
    see the whole file or none. Raises the OSError of a failed write, its temp file removed."""
    tmp = os.path.join(os.path.dirname(final), tmp_name(key))
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError:
        unlink_quiet(tmp)
        raise


def quarantine(root: str, key: str, max_files: int) -> bool:
    """Move page ``key``'s file into the quarantine (True), or delete it once that holds
    ``max_files`` files or the move fails (False)."""
    src = page_path(root, key)
    qdir = os.path.join(root, _QUARANTINE)
    try:
        os.makedirs(qdir, exist_ok=True)
        if len(os.listdir(qdir)) < max_files:  # rare path, a listdir is fine
            os.replace(src, os.path.join(qdir, f"{key}.{os.getpid()}.{time.time_ns()}.bad"))
            return True
    except OSError:
        pass
    unlink_quiet(src)
    return False


def clear(root: str) -> None:
    """Delete every page file and the quarantine (other writers' fresh temp files are left)."""
    try:
        dirs = fanout_dirs(root)
    except OSError:
        return
    for d in dirs:
        for name in listdir_quiet(d.path):
            if name.endswith(".kv"):
                unlink_quiet(os.path.join(d.path, name))
    qdir = os.path.join(root, _QUARANTINE)
    for name in listdir_quiet(qdir):
        unlink_quiet(os.path.join(qdir, name))


def in_page_cache(path: str) -> bool:
    """Whether the file's first, middle and last bytes are in the OS page cache: read without
    waiting for the device (``RWF_NOWAIT``). False where they are not, or it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        size, byte = os.fstat(fd).st_size, bytearray(1)
        return size > 0 and all(os.preadv(fd, [byte], at, os.RWF_NOWAIT) == 1
                                for at in (0, size // 2, size - 1))
    except OSError:  # BlockingIOError: the device would be read; EOPNOTSUPP: cannot tell
        return False
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def listdir_quiet(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
