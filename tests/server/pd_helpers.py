"""Helpers of the prefill/decode tests (``test_pd*.py``): ``deepinfer serve`` workers in their
own processes, the co-located reference server, greedy multi-turn chats."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import start_server

REPO = Path(__file__).resolve().parents[2]
PS = 4  # page size of every server here
TURNS = 3
USERS = [  # three conversations, three turns each (all within the tiny model's 512 tokens)
    ["Prefix caching reuses the key value cache of earlier requests in a conversation. "
     "Explain it to me.", "Why does it save compute?", "Thanks, and what about disks?"],
    ["The quick brown fox jumps over the lazy dog. Caching saves compute. Tell me a story "
     "about a fox.", "Make it shorter.", "Now a title for it."],
    ["hello world how are you today? I am fine, thanks. 0 1 2 3 4 5 6 7 8 9 a b c d e f g h",
     "Count again, please.", "And backwards?"],
]
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``deepinfer serve`` in its own process."""

    def __init__(self, tiny_llama: Path, log: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.cli", "serve", str(tiny_llama), "--port",
             str(self.port), "--page-size", str(PS), "--num-pages", "1024", "--max-model-len",
             "512", "--host-cache-gb", "0", "--threads", "1", "--log-level", "warning",
             "--generation-config", "vllm", *args],
            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> Worker:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"worker did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"deepinfer:{name}"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    """The reference: one ``both`` server, local tiers only."""
    srv = start_server(tiny_llama, engine_kw={"enable_disk_cache": False, "host_cache_gb": 0})
    yield srv
    srv.stop()


def chat(url: str, messages: list[dict], stream: bool, max_tokens: int = 8) -> tuple[str, dict]:
    """(reply text, usage) of a greedy chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]
    text, usage = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(text), usage


def run_conversations(url: str, salt: str) -> list[list[tuple[str, dict]]]:
    """Every conversation's turns; the conversations of a turn go concurrently, each turn
    alternating streamed and not."""
    history = [[] for _ in USERS]
    out: list[list[tuple[str, dict]]] = [[] for _ in USERS]
    with ThreadPoolExecutor(len(USERS)) as pool:
        for t in range(TURNS):
            for i, turns in enumerate(USERS):
                # the salt makes each run of the conversations start cold in every cache
                first = f"[{salt}] " + " ".join([turns[0]] * 3)  # long enough to matter
                history[i].append({"role": "user", "content": first if t == 0 else turns[t]})
            got = list(pool.map(lambda i: chat(url, history[i], stream=(i + t) % 2 == 1),
                                range(len(USERS))))
            for i, (text, usage) in enumerate(got):
                history[i].append({"role": "assistant", "content": text})
                out[i].append((text, usage))
    return out
