"""Client mode: drive a workload against any OpenAI-compatible endpoint.

Works against our server, llama.cpp's ``llama-server`` or vLLM, so results compare side by
side. Chat turns go to ``/chat/completions``, token-prompt turns (block-trace replay) to
``/completions`` with ``prompt`` as a token id list. Every request streams
(``stream: true``, ``stream_options.include_usage``) so TTFT and TPOT are measured here.

Cached prompt tokens are read from whatever the server reports:
``usage.prompt_tokens_details.cached_tokens`` (OpenAI, vLLM, ours),
``usage.prompt_cache_hit_tokens`` (DeepSeek), ``timings.cache_n`` / ``timings.prompt_n``
(llama.cpp), and per tier from ``usage.prompt_tokens_details.cached_tokens_by_tier``
(``{"device": n, "host": n, "disk": n}``, our extension).

Sessions run concurrently, each one turn at a time: turn k+1 is sent only after turn k's
reply arrived (and was appended to the history), never before its ``arrival_s``. At most
``concurrency`` requests are in flight; waiting turns are served first come first served,
which interleaves multi-turn sessions round-robin. The run is bounded: at most
``max_requests`` requests, none started after ``max_duration_s``, each cut after
``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from deepinfer.bench.metrics import RequestRecord
from deepinfer.bench.sessions import ConversationState, Session, Turn, Workload


@dataclass
class ClientConfig:
    base_url: str  # "http://127.0.0.1:8000" or ".../v1"
    model: str
    api_key: str | None = None
    concurrency: int = 8
    request_timeout_s: float = 300.0
    max_requests: int | None = None
    max_duration_s: float | None = None
    use_recorded_replies: bool = True
    temperature: float = 0.0
    ignore_eos: bool = False  # ask for exactly max_tokens (vLLM, llama.cpp honour it)
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    trust_env: bool = False  # proxies from the environment are ignored unless True

    @property
    def api_base(self) -> str:
        b = self.base_url.rstrip("/")
        return b if b.endswith("/v1") else b + "/v1"


@dataclass
class UsageInfo:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)


def parse_usage(
    usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None = None
) -> UsageInfo:
    """Prompt / completion / cached token counts from a response's ``usage`` and
    (llama.cpp) ``timings``; ``cached_tokens`` is None when the server reports none."""
    u = usage or {}
    t = timings or {}
    info = UsageInfo(prompt_tokens=_int(u.get("prompt_tokens")),
                     completion_tokens=_int(u.get("completion_tokens")))
    details = u.get("prompt_tokens_details") or {}
    if isinstance(details, Mapping):
        info.cached_tokens = _int(details.get("cached_tokens"))
        tiers = details.get("cached_tokens_by_tier")
        if isinstance(tiers, Mapping):
            info.cached_by_tier = {str(k): int(v) for k, v in tiers.items() if v is not None}
    if info.cached_tokens is None:
        info.cached_tokens = _int(u.get("prompt_cache_hit_tokens"))
    cache_n, prompt_n = _int(t.get("cache_n")), _int(t.get("prompt_n"))
    if info.cached_tokens is None and cache_n is not None:
        info.cached_tokens = cache_n
    if info.prompt_tokens is None and prompt_n is not None:
        info.prompt_tokens = prompt_n + (cache_n or 0)
    if info.completion_tokens is None:
        info.completion_tokens = _int(t.get("predicted_n"))
    return info


def _int(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


@dataclass
class StreamResult:
    text: str
    first_token_s: float | None
    finish_s: float
    chunks: int
    usage: UsageInfo


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str], t0: float
) -> StreamResult:
    """POST one streaming request; times are ``perf_counter() - t0``."""
    text: list[str] = []
    first: float | None = None
    last: float | None = None
    chunks = 0
    usage: Mapping[str, Any] | None = None
    timings: Mapping[str, Any] | None = None
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code >= 400:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if not data:
                continue
            obj = json.loads(data)
            if obj.get("error"):
                raise RuntimeError(f"server error: {obj['error']}")
            now = time.perf_counter() - t0
            got = False
            for ch in obj.get("choices") or []:
                delta = ch.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ch.get("text")
                if piece:
                    text.append(piece)
                    got = True
                if delta.get("tool_calls"):
                    got = True
            if got:
                chunks += 1
                last = now
                if first is None:
                    first = now
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("timings"):
                timings = obj["timings"]
    end = time.perf_counter() - t0
    return StreamResult(text="".join(text), first_token_s=first,
                        finish_s=last if last is not None else end, chunks=chunks,
                        usage=parse_usage(usage, timings))


def _body(cfg: ClientConfig, turn: Turn, messages: list[dict] | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": turn.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    if messages is None:
        body["prompt"] = turn.tokens()
        return cfg.api_base + "/completions", body
    body["messages"] = messages
    return cfg.api_base + "/chat/completions", body


async def run_workload_async(cfg: ClientConfig, workload: Workload) -> list[RequestRecord]:
    """Run every session of ``workload`` against the endpoint; records in completion order."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    total = workload.num_requests
    if cfg.max_requests is not None:
        total = min(total, cfg.max_requests)
    records: list[RequestRecord] = []
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    issued = 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc=f"client {workload.name}", unit="req", disable=not cfg.progress)

    def out_of_budget() -> bool:
        if cfg.max_requests is not None and issued >= cfg.max_requests:
            return True
        return cfg.max_duration_s is not None and time.perf_counter() - t0 >= cfg.max_duration_s

    async def run_session(client: httpx.AsyncClient, session: Session) -> None:
        nonlocal issued
        state = ConversationState(session, use_recorded_replies=cfg.use_recorded_replies)
        for turn in session.turns:
            wait = 0.0
            if turn.arrival_s is not None:
                if cfg.max_duration_s is not None and turn.arrival_s >= cfg.max_duration_s:
                    return  # would start after the run's end
                wait = turn.arrival_s - (time.perf_counter() - t0)
            wait = max(wait, turn.think_time_s)
            if wait > 0:
                await asyncio.sleep(wait)
            async with sem:
                if out_of_budget():
                    return
                issued += 1
                is_tokens = turn.prompt_tokens is not None
                messages = None if is_tokens else state.request_messages(turn)
                url, body = _body(cfg, turn, messages)
                sent = time.perf_counter() - t0
                rec = RequestRecord(
                    request_id=turn.request_id, session_id=session.session_id, arrival_s=sent,
                    first_token_s=None, finish_s=None, prompt_tokens=0, cached_tokens=0,
                    completion_tokens=0, ideal_cached_tokens=turn.ideal_cached_tokens)
                try:
                    res = await asyncio.wait_for(
                        stream_request(client, url, body, headers, t0), cfg.request_timeout_s)
                except Exception as e:  # noqa: BLE001 - every failure becomes a record
                    rec.error = f"{type(e).__name__}: {e}"[:500]
                    records.append(rec)
                    bar.update(1)
                    return  # the session's history is broken: stop it
                u = res.usage
                rec.first_token_s = res.first_token_s
                rec.finish_s = res.finish_s
                rec.prompt_tokens = (u.prompt_tokens if u.prompt_tokens is not None
                                     else len(body.get("prompt") or []))
                rec.cached_tokens = u.cached_tokens or 0
                rec.cached_reported = u.cached_tokens is not None
                rec.cached_by_tier = dict(u.cached_by_tier)
                rec.completion_tokens = (u.completion_tokens if u.completion_tokens is not None
                                         else res.chunks)
                records.append(rec)
                bar.update(1)
            state.add_reply(turn, res.text)

    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s))
    limits = httpx.Limits(max_connections=max(1, cfg.concurrency),
                          max_keepalive_connections=max(1, cfg.concurrency))
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                     trust_env=cfg.trust_env) as client:
            tasks = [asyncio.create_task(run_session(client, s)) for s in workload.sessions]
            if not tasks:
                return records
            overall = None
            if cfg.max_duration_s is not None:
                overall = cfg.max_duration_s + cfg.request_timeout_s + 5.0
            done, pending = await asyncio.wait(tasks, timeout=overall)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
    finally:
        bar.close()
    return records


def run_workload(cfg: ClientConfig, workload: Workload) -> list[RequestRecord]:
    """Blocking wrapper of ``run_workload_async``."""
    return asyncio.run(run_workload_async(cfg, workload))
