"""Real networked stores on loopback for the tests: Mooncake Store (``mooncake_master`` plus a
``mooncake_client`` that lends the pool its memory) and ``redis-server``. Started per test
module, stopped after it; ``kill`` / ``start`` again let a test take a store down mid-run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on {port}: {log.read_text()[-2000:]}")


def need(binary: str) -> str:
    """The binary's path; in CI a missing one fails (scripts/setup.sh installs it), elsewhere
    the test is skipped."""
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI"):
            raise RuntimeError(f"{binary} not installed (scripts/setup.sh installs it)")
        pytest.skip(f"{binary} not installed (scripts/setup.sh installs it)")
    return path


# A store call is waited for 2 s by default; on a loaded 2-core CI machine a first Mooncake get
# (the client's connection setup) can take longer, marking the store down and turning the rest of
# a request's pages into misses that the tests' exact counts do not expect.
GENEROUS = {"timeout_s": "10"}


@dataclass
class Service:
    """One store: its processes (started in order, the first one listening on ``port``)."""

    commands: list[list[str]]
    ports: list[int]
    log_dir: Path
    url: str
    options: dict[str, str] = field(default_factory=lambda: dict(GENEROUS))  # --kv-store-option
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> Service:
        for i, (cmd, port) in enumerate(zip(self.commands, self.ports)):
            log = self.log_dir / f"{Path(cmd[0]).name}.{i}.log"
            proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs.append(proc)
            _wait_port(port, proc, log)
        return self

    def kill(self) -> None:
        """SIGKILL every process (a store that dies, not one that shuts down)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        self.procs.clear()


def mooncake(log_dir: Path, segment_bytes: int = 256 << 20) -> Service:
    master, holder = need("mooncake_master"), need("mooncake_client")
    rpc, meta, client = free_port(), free_port(), free_port()
    metadata = f"http://127.0.0.1:{meta}/metadata"
    return Service(
        [[master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--default_kv_lease_ttl=100",
          "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
          f"--http_metadata_server_port={meta}"],
         [holder, "--host=127.0.0.1", f"--port={client}", f"--global_segment_size={segment_bytes}",
          f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}",
          "--protocol=tcp"]],
        [rpc, client], log_dir, f"mooncake://127.0.0.1:{rpc}",
        {**GENEROUS, "metadata_server": metadata})


def redis(log_dir: Path) -> Service:
    server = need("redis-server")
    port = free_port()
    return Service([[server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--maxmemory", "256mb",
                     "--maxmemory-policy", "allkeys-lru"]],
                   [port], log_dir, f"redis://127.0.0.1:{port}")


SERVICES = {"mooncake": mooncake, "redis": redis}
