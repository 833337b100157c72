"""The engine's thread policy: how many compute threads, and how idle ones wait.

PyTorch's CPU build runs its intra-op parallelism on an OpenMP pool (GNU libgomp). A decode step
starts one parallel region per matmul and per attention call, a few hundred a step, with short
gaps of Python between them. Two ways of waiting in those gaps both fail somewhere:

- Workers that sleep at once (``OMP_WAIT_POLICY=PASSIVE``) must be woken for every region; on a
  virtual machine, where a woken vCPU waits for the hypervisor, that cost ~50 us a region, 40% of
  a batch-1 SmolLM2 step (docs/figures/execution.md).
- Workers that spin for long (libgomp's default, ~300,000 spins) hold a core between steps too,
  and next to a busy process the spinning worker and the thread it waits for take turns on the
  cores: a step ran several times slower.

So ``import deepinfer`` sets a short spin (``GOMP_SPINCOUNT``, about the gaps inside a step),
after which an idle worker sleeps, and ``CoreShare`` runs the compute on the cores the rest of the
machine leaves free: next to a busy process the engine drops to the cores left (down to one
thread, where no worker waits at all) and takes them back when the neighbour stops.

libgomp reads its environment once, when the library is loaded, i.e. at ``import torch``. So
``set_process_defaults`` runs from ``deepinfer/__init__.py`` before anything imports torch, and
only fills in variables the user has not set. If torch was imported first, the policy cannot be
changed any more; ``apply_thread_policy`` then says so instead of failing. (Intel's OpenMP, where
torch is linked to it, keeps ``KMP_BLOCKTIME=0``: its workers sleep at once.)

The engine's helper threads do not add compute threads of their own: torch's intra-op thread
count is process-wide, its inter-op pool (unused by the engine) is cut to one thread, and the
tokenizer's Rust thread pool is switched off (``TOKENIZERS_PARALLELISM=false``; the engine
tokenizes one request at a time).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Variables set (if unset) before torch loads its OpenMP runtime.
SPIN_COUNT = "10000"  # libgomp spins of an idle worker before it sleeps (tens of microseconds)
PROCESS_DEFAULTS = {
    "GOMP_SPINCOUNT": SPIN_COUNT,
    "KMP_BLOCKTIME": "0",  # Intel's OpenMP runtime, where torch is linked to it: sleep at once
    "TOKENIZERS_PARALLELISM": "false",  # no Rust thread pool competing with the matmuls
}

_torch_loaded_first = False  # torch was imported before deepinfer: its OpenMP ignored our policy


def set_process_defaults() -> None:
    """Fill in ``PROCESS_DEFAULTS``; call before torch is imported (``deepinfer/__init__`` does)."""
    global _torch_loaded_first
    user_policy = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    _torch_loaded_first = "torch" in sys.modules and not user_policy
    for name, value in PROCESS_DEFAULTS.items():
        if name != "GOMP_SPINCOUNT" or not user_policy:  # the user's wait policy stands as given
            os.environ.setdefault(name, value)


def affinity() -> set[int]:
    """The cores this process may run on (its CPU affinity, e.g. a container's or taskset's share)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    return len(affinity())


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # intra-op compute threads
    wait_policy: str  # how idle OpenMP workers wait, as the runtime saw it at load time
    note: str  # why the wait policy is not ours, or ""

    def describe(self) -> str:
        text = f"{self.threads} thread{'' if self.threads == 1 else 's'}, OpenMP workers {self.wait_policy}"
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
        note = ("torch was imported before deepinfer, so idle OpenMP workers spin long; import "
                f"deepinfer first or set GOMP_SPINCOUNT={SPIN_COUNT}")
    elif os.environ.get("GOMP_SPINCOUNT") != SPIN_COUNT or "OMP_WAIT_POLICY" in os.environ:
        note = "set by the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT"
    return ThreadPolicy(threads=n, wait_policy=wait_policy(), note=note)


def wait_policy() -> str:
    """How libgomp's idle workers wait, from the variables it read at load."""
    if _torch_loaded_first:
        return "spin ~300000 times, then sleep (libgomp default)"
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    spins = os.environ.get("GOMP_SPINCOUNT")
    if spins is not None:
        return f"spin {spins} times, then sleep"
    return {"PASSIVE": "sleep at once", "ACTIVE": "spin"}.get(policy, "spin ~300000 times, then sleep")


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.monotonic()
    busy: float  # CPU seconds every process spent on this process's cores (/proc/stat)
    own: float  # CPU seconds of this process


def busy_seconds(stat_text: str, cpus: set[int]) -> float:
    """Busy CPU seconds (user, nice, system, irq, softirq, steal) of ``cpus`` from /proc/stat."""
    ticks = os.sysconf("SC_CLK_TCK")  # /proc/stat exists on Linux only, and so does this
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in rest.split()]
            total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # idle (3) and iowait (4) left out
    return total / ticks


def sample_cpu(cpus: set[int], stat: Path = Path("/proc/stat")) -> CpuSample | None:
    """Now, or None where /proc/stat cannot be read (then the thread count stays as set)."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    return CpuSample(time.monotonic(), busy_seconds(text, cpus), time.process_time())


class CoreShare:
    """Compute threads on the cores the rest of the machine leaves free.

    Every ``interval`` seconds (checked by ``update``, which the engine calls each step) the CPU
    time other processes took on this process's cores in that while sets the thread count: the
    cores left, rounded, at least 1 and at most ``limit``. Our own threads (tier loaders, the
    server, spinning workers) count as ours, not as a neighbour's.
    """

    def __init__(self, limit: int, interval: float = 0.25,
                 sample: Callable[[], CpuSample | None] | None = None) -> None:
        self.limit = limit
        self.threads = limit
        self.interval = interval
        self.others = 0.0  # cores the other processes used in the last interval
        cpus = affinity()
        self.cores = len(cpus)
        self._sample = sample or (lambda: sample_cpu(cpus))
        self._last = self._sample()

    def update(self) -> int:
        """The thread count for the next step (torch's, set here when it changes)."""
        if self._last is None or time.monotonic() - self._last.wall < self.interval:
            return self.threads
        now = self._sample()
        if now is None or now.wall <= self._last.wall:
            return self.threads
        span = now.wall - self._last.wall
        self.others = max(0.0, (now.busy - self._last.busy) - (now.own - self._last.own)) / span
        self._last = now
        target = max(1, min(self.limit, int(self.cores - self.others + 0.5)))
        if target != self.threads:
            import torch

            torch.set_num_threads(target)
            self.threads = target
        return target
