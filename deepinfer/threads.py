"""The engine's thread policy: how many compute threads, and how idle ones wait.

PyTorch's CPU build runs its intra-op parallelism on an OpenMP pool (GNU libgomp). By default an
idle libgomp worker spins for a while before it sleeps, so every short gap between two matmuls of a
decode step is spent busy-waiting. On a machine where anything else runs (a neighbour process,
our own HTTP server, tier writers, the tokenizer) the spinning workers and the real work take
turns on the same cores and a step can take many times longer. A passive wait policy makes idle
workers sleep at once; the cost is a wake-up per parallel region, small next to a matmul.

libgomp reads its environment once, when the library is loaded, i.e. at ``import torch``. So
``set_process_defaults`` runs from ``deepinfer/__init__.py`` before anything imports torch, and
only fills in variables the user has not set. If torch was imported first, the policy cannot be
changed any more; ``apply_thread_policy`` then says so instead of failing.

The engine's helper threads do not add compute threads of their own: torch's intra-op thread
count is process-wide, its inter-op pool (unused by the engine) is cut to one thread, and the
tokenizer's Rust thread pool is switched off (``TOKENIZERS_PARALLELISM=false``; the engine
tokenizes one request at a time). Tier writer/loader threads mostly copy and checksum pages; the
parallel regions they start sleep when idle under the passive policy instead of spinning.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# Variables set (if unset) before torch loads its OpenMP runtime.
PROCESS_DEFAULTS = {
    "OMP_WAIT_POLICY": "PASSIVE",  # libgomp: idle workers sleep at once (GOMP_SPINCOUNT 0)
    "KMP_BLOCKTIME": "0",  # the same for Intel's OpenMP runtime, where torch is linked to it
    "TOKENIZERS_PARALLELISM": "false",  # no Rust thread pool competing with the matmuls
}

_torch_loaded_first = False  # torch was imported before deepinfer: its OpenMP ignored our policy


def set_process_defaults() -> None:
    """Fill in ``PROCESS_DEFAULTS``; call before torch is imported (``deepinfer/__init__`` does)."""
    global _torch_loaded_first
    _torch_loaded_first = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # intra-op compute threads
    wait_policy: str  # OMP_WAIT_POLICY as the OpenMP runtime saw it at load time
    note: str  # why the wait policy is not passive, or ""

    def describe(self) -> str:
        text = f"{self.threads} thread{'' if self.threads == 1 else 's'}, OpenMP wait policy {self.wait_policy}"
        return f"{text} ({self.note})" if self.note else text


def apply_thread_policy(threads: int | None) -> ThreadPolicy:
    """Set torch's compute threads (default: ``available_cores()``) and report the wait policy."""
    import torch

    n = threads or available_cores()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op use; the engine has none
        pass
    note = ""
    if _torch_loaded_first:
        note = ("torch was imported before deepinfer, so idle OpenMP workers spin; import deepinfer "
                "first or set OMP_WAIT_POLICY=PASSIVE")
    elif os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        note = "set by the user's OMP_WAIT_POLICY"
    policy = os.environ.get("OMP_WAIT_POLICY", "default") if not _torch_loaded_first else "default"
    return ThreadPolicy(threads=n, wait_policy=policy.upper(), note=note)
