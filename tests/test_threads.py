"""The thread policy: a short spin set before torch loads OpenMP, the thread count following the
cores other processes leave free, and outputs independent of thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.threads import SPIN_COUNT, CoreShare, CpuSample, apply_thread_policy, busy_seconds


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "TOKENIZERS_PARALLELISM",
                        "OMP_NUM_THREADS")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints the settings it loaded with
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120)


def test_importing_deepinfer_makes_openmp_workers_spin_briefly_and_sets_threads():
    out = _run("import deepinfer, os, torch\n"
               "from deepinfer.threads import apply_thread_policy\n"
               "p = apply_thread_policy(1)\n"
               "print(p.threads, torch.get_num_threads(), repr(p.note), os.environ['TOKENIZERS_PARALLELISM'])\n"
               "print(p.wait_policy)")
    assert f"GOMP_SPINCOUNT = '{SPIN_COUNT}'" in out.stderr  # what libgomp loaded with
    first, policy = out.stdout.splitlines()
    assert first.split() == ["1", "1", "''", "false"]
    assert policy == f"spin {SPIN_COUNT} times, then sleep"


def test_the_users_wait_policy_stands():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT",)}
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_DISPLAY_ENV="VERBOSE")
    out = subprocess.run([sys.executable, "-c", "import deepinfer, torch\n"
                          "from deepinfer.threads import apply_thread_policy\n"
                          "p = apply_thread_policy(1)\nprint(p.wait_policy, '|', p.note)"],
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    assert "GOMP_SPINCOUNT = '0'" in out.stderr
    assert out.stdout.strip() == "sleep at once | set by the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT"


def test_torch_imported_first_is_reported():
    out = _run("import torch, deepinfer\n"
               "from deepinfer.threads import apply_thread_policy\n"
               "print(apply_thread_policy(None).note)")
    assert f"GOMP_SPINCOUNT = '{SPIN_COUNT}'" not in out.stderr
    assert "torch was imported before deepinfer" in out.stdout


def test_greedy_outputs_identical_across_thread_counts(tiny_llama):
    before = torch.get_num_threads()
    prompts = [[1, 5, 9, 12, 7, 3, 22, 40], [2, 8, 8, 31]]
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = {}
    try:
        for threads in (1, 2):
            llm = LLM(str(tiny_llama), threads=threads, progress=False, host_cache_gb=0,
                      enable_disk_cache=False)
            assert torch.get_num_threads() == threads
            outs[threads] = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        apply_thread_policy(before)
    assert outs[1] == outs[2]
    assert all(len(t) == 24 for t in outs[1])


def test_busy_seconds_counts_the_given_cores_busy_states():
    ticks = os.sysconf("SC_CLK_TCK")
    stat = ("cpu  9 9 9 9 9 9 9 9 0 0\n"
            f"cpu0 {ticks} 0 {ticks} 500 7 0 0 {ticks} 0 0\n"  # user, system, steal: 3 s; idle, iowait out
            f"cpu1 {ticks} {ticks} 0 0 0 {ticks} {ticks} 0 0 0\n"  # nice, irq, softirq, user: 4 s
            f"cpu2 {100 * ticks} 0 0 0 0 0 0 0 0 0\nintr 5\n")
    assert busy_seconds(stat, {0, 1}) == 7.0
    assert busy_seconds(stat, {1}) == 4.0


def test_threads_follow_the_cores_other_processes_leave(threads):
    """A neighbour's CPU time (busy time of our cores minus our own) takes a core away; when it
    stops, the core comes back; our own CPU time never does."""
    samples = iter([CpuSample(0.0, 0.0, 0.0),
                    CpuSample(1.0, 2.0, 1.0),  # 2 busy core-seconds, 1 ours: a neighbour on one core
                    CpuSample(2.0, 3.9, 2.9),  # only ours
                    CpuSample(3.0, 4.4, 3.0)])  # a neighbour at 0.4 core: 1.6 cores left, rounds to 2
    share = CoreShare(2, interval=0.0, sample=lambda: next(samples))
    share.cores = 2
    assert (share.update(), torch.get_num_threads(), share.others) == (1, 1, 1.0)
    assert (share.update(), torch.get_num_threads()) == (2, 2)
    assert share.update() == 2 and abs(share.others - 0.4) < 1e-9


def test_a_real_busy_neighbour_is_seen(threads):
    """Against /proc/stat: a spinning child process (on our cores, by inheritance) reads as about
    one core taken."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        share = CoreShare(max(2, torch.get_num_threads()), interval=0.5)
        time.sleep(0.6)
        share.update()
    finally:
        child.kill()
        child.wait()
    assert share.others > 0.7


def test_fixed_threads_keeps_the_count(tiny_llama):
    llm = LLM(str(tiny_llama), threads=1, fixed_threads=True, progress=False, host_cache_gb=0,
              enable_disk_cache=False)
    assert llm.engine.cores is None
    llm = LLM(str(tiny_llama), threads=1, progress=False, host_cache_gb=0, enable_disk_cache=False)
    assert llm.engine.cores is not None and llm.engine.cores.limit == 1
