"""Helpers of the server tests: engines over the tiny Llama, servers on loopback ports."""

from __future__ import annotations

import time
from dataclasses import fields

from deepinfer.config import EngineConfig
from deepinfer.engine import LLMEngine
from deepinfer.server.serve import BackgroundServer
from deepinfer.server.config import ServerConfig

PAGE = 4


def no_lower_tiers() -> dict:
    """Engine arguments turning L2/L3 off (where the engine has them): L1 only."""
    names = {f.name for f in fields(EngineConfig)}
    out = {}
    if "host_cache_gb" in names:
        out["host_cache_gb"] = 0.0
    if "enable_disk_cache" in names:
        out["enable_disk_cache"] = False
    return out


def make_engine(tiny_llama, **kw) -> LLMEngine:
    args = dict(model=str(tiny_llama), page_size=PAGE, num_pages=1024, max_model_len=512,
                max_num_batched_tokens=512, progress=False)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def start_server(tiny_llama, engine_kw=None, **server_kw) -> BackgroundServer:
    cfg = ServerConfig(**{"port": 0, "log_level": "warning", **server_kw})
    return BackgroundServer(make_engine(tiny_llama, **(engine_kw or {})), cfg).start()


def wait_idle(srv: BackgroundServer, timeout: float = 120.0) -> dict:
    """Wait until no request is live and every page is free or evictable cache; return the
    page accounting (fails the test if that does not happen)."""
    t0 = time.monotonic()
    while True:
        s = srv.async_engine.call_sync(srv.async_engine.kv_snapshot)
        idle = (s["live_requests"] == 0 and s["engine_requests"] == 0
                and s["free_pages"] + s["evictable_cached_pages"] == s["total_pages"] - 1)
        if idle:
            return s
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"pages not given back: {s}")
        time.sleep(0.05)
