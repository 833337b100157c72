"""Real worker processes (``deepinfer serve`` over the tiny Llama, a small L1 so routing
matters) and a real ``deepinfer router`` process, all on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

PAGE = 4
WORKER_PAGES = 96  # 380 tokens of KV: a few conversations, not all of them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


@dataclass
class Proc:
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def start_worker(model, *extra: str, port: int | None = None) -> Proc:
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "serve", str(model), "--port", str(port),
         "--page-size", str(PAGE), "--num-pages", str(WORKER_PAGES), "--max-model-len", "256",
         "--no-disk-cache", "--host-cache-gb", "0", "--threads", "1", "--log-level", "warning",
         *extra], env=_env())
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "deepinfer serve")
    return Proc(url, proc)


def start_router(model, workers: list[str], *extra: str) -> Proc:
    port = free_port()
    args = [a for w in workers for a in ("--worker", w)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "router", *args, "--model", str(model),
         "--port", str(port), "--health-interval", "0.2", "--log-level", "warning", *extra],
        env=_env())
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "deepinfer router")
    return Proc(url, proc)


@pytest.fixture(scope="module")
def workers(tiny_llama):
    procs = [start_worker(tiny_llama) for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()
