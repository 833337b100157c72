"""Where the loader keeps what it derives from checkpoints (converted GGUFs, file hashes)."""

import os
from pathlib import Path

CACHE_ENV = "DEEPINFER_CACHE_DIR"


def cache_dir() -> Path:
    """`$DEEPINFER_CACHE_DIR`, else `~/.cache/deepinfer`; read on every call so tests can redirect it."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "deepinfer"
