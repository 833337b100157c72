"""Router test processes: real workers (``deepinfer serve`` over the tiny Llama, a small L1 so routing
matters) and the real router app (uvicorn in a thread), all on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

PAGE = 4
WORKER_PAGES = 96  # 380 tokens of KV: a few conversations, not all of them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    """Poll ``/health`` until 200; the deadline allows a start-up of minutes (several workers
    importing torch at once on a loaded 2-core machine), and a dead ``proc`` fails at once."""
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


def spawn_worker(model, *extra: str, port: int | None = None) -> Proc:
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "serve", str(model), "--port", str(port),
         "--page-size", str(PAGE), "--num-pages", str(WORKER_PAGES), "--max-model-len", "256",
         "--no-disk-cache", "--host-cache-gb", "0", "--threads", "1", "--log-level", "warning",
         *extra], env=_env())
    return Proc(f"http://127.0.0.1:{port}", proc)


def start_worker(model, *extra: str, port: int | None = None) -> Proc:
    w = spawn_worker(model, *extra, port=port)
    wait_healthy(w.url, w.proc, "deepinfer serve")
    return w


class RouterThread:
    """The router app under uvicorn on a loopback port, in a thread of the test process."""

    def __init__(self, model, workers: list[str], policy: str = "kv", **config) -> None:
        import uvicorn

        from deepinfer.loader import load_checkpoint
        from deepinfer.router.app import Router
        from deepinfer.router.config import RouterConfig

        cfg = RouterConfig(workers=workers, policy=policy, model=str(model), port=0,
                           health_interval_s=0.2, log_level="warning", **config)
        self.router = Router(cfg, load_checkpoint(model, progress=False).tokenizer)
        app = self.router.build_app()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() - t0 < 300, "router did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
