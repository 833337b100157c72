"""The thread policy: applied before torch loads OpenMP, and outputs independent of thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.threads import apply_thread_policy


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints the settings it loaded with
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120)


def test_importing_deepinfer_makes_openmp_workers_sleep_and_sets_threads():
    out = _run("import deepinfer, os, torch\n"
               "from deepinfer.threads import apply_thread_policy\n"
               "p = apply_thread_policy(1)\n"
               "print(p.threads, torch.get_num_threads(), p.wait_policy, repr(p.note), "
               "os.environ['TOKENIZERS_PARALLELISM'])")
    assert "GOMP_SPINCOUNT = '0'" in out.stderr  # passive: no spinning before sleeping
    assert out.stdout.split() == ["1", "1", "PASSIVE", "''", "false"]


def test_torch_imported_first_is_reported():
    out = _run("import torch, deepinfer\n"
               "from deepinfer.threads import apply_thread_policy\n"
               "print(apply_thread_policy(None).note)")
    assert "GOMP_SPINCOUNT = '0'" not in out.stderr
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
