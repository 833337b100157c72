"""Content hashes of weight files, computed once per file version.

Hashing a few hundred MB takes about a second, and every start of the engine needs the hash
(it is the model identity the KV cache is keyed by), so each file's digest is remembered in a
small JSON index keyed by (absolute path, size, mtime_ns): a rewritten file is hashed again.
"""

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from deepinfer.loader.cache import cache_dir

DIGEST_SIZE = 32  # bytes: 64 hex characters


def _new_hash() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def _index_path() -> Path:
    return cache_dir() / "fingerprints.json"


def _read_index() -> dict:
    try:
        return json.loads(_index_path().read_text())
    except (OSError, ValueError):  # missing or damaged: it is only a cache
        return {}


def _write_index(index: dict) -> None:
    """Atomic replace, so a concurrent reader never sees half a file; entries of deleted files are dropped."""
    index = {key: entry for key, entry in index.items() if os.path.exists(key)}
    path = _index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp, path)


def file_digest(path: Path) -> str:
    """blake2b hex digest of one file's bytes, cached by (absolute path, size, mtime_ns)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = str(path)
    index = _read_index()
    entry = index.get(key)
    if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return entry["blake2b"]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, _new_hash).hexdigest()
    index = _read_index()  # re-read: another process may have added entries meanwhile
    index[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": digest}
    _write_index(index)
    return digest


def fingerprint(files: Iterable[Path]) -> str:
    """One hex digest for a set of weight files: blake2b over (name, file digest) in name order.

    Names take part so that two shards swapping contents changes the fingerprint.
    """
    combined = _new_hash()
    for path in sorted(Path(f) for f in files):
        combined.update(f"{path.name}\0{file_digest(path)}\n".encode())
    return combined.hexdigest()
