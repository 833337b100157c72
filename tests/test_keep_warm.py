"""The core warmer (``keep_warm.py``): SCHED_IDLE threads that poll only while a step is open."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from deepinfer.keep_warm import DISABLE_ENV, CoreWarmer, keep_warm_kernel
from native_helpers import loaded

CPU = torch.device("cpu")


def _idle_threads() -> dict[int, str]:
    """This process's SCHED_IDLE threads: id -> state (R running or runnable, S sleeping)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                out[tid] = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            pass
    return out


def _wait_for(state: str, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if set(_idle_threads().values()) == {state}:
            return True
        time.sleep(0.01)
    return False


def test_one_thread_or_switched_off_starts_nothing(monkeypatch):
    assert not CoreWarmer(1, CPU).enabled
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not CoreWarmer(4, CPU).enabled
    with CoreWarmer(4, CPU).during():  # a no-op
        pass


def test_warmers_poll_only_while_a_step_is_open():
    loaded(keep_warm_kernel())
    warmer = CoreWarmer(2, CPU)
    assert warmer.enabled
    assert _wait_for("S")  # started, at SCHED_IDLE, asleep
    with warmer.during():
        assert _wait_for("R")
        with warmer.during():  # steps may overlap (overlap scheduling): polling until the last ends
            pass
        assert _wait_for("R")
    assert _wait_for("S")


@pytest.mark.parametrize("on", [False, True])
def test_greedy_outputs_do_not_depend_on_the_warmer(tiny_llama, threads, on, monkeypatch):
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    threads(2)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    if not on:
        monkeypatch.setenv(DISABLE_ENV, "1")
    llm = LLM(str(tiny_llama), threads=2, progress=False)
    assert llm.engine.runner.warmer.enabled == (on and keep_warm_kernel().loaded)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    want = [o.token_ids for o in LLM(str(tiny_llama), threads=1, progress=False).generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
