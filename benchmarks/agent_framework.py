"""Agent workload through a real framework: the OpenAI Agents SDK driving tool calls against
a live DeepInfer server, per step: prompt tokens, cache hits vs the ideal, TTFT.

    pip install "openai-agents>=0.24" && python benchmarks/agent_framework.py [--steps 8] [--runs 3]
    python benchmarks/agent_framework.py --model /path/to/qwen2.5-instruct   # a tool-capable model

The default model is the tiny Llama of ``tests/server/tool_model.py``, trained in seconds to
answer each turn with a tool call, so the framework loops for ``--steps`` model calls whatever
the hardware; its figures are about the cache and the server, not model quality. The ideal hit
of step k is step k-1's prompt + reply in whole pages (what an exact token extension allows).
TTFT per step is the server's own (``deepinfer:time_to_first_token_seconds`` sum, read from
/metrics before and after each model call); the calls are sequential, so each difference is
one request's. Prints ``lscpu``'s model name with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TTFT_SUM = re.compile(r"^deepinfer:time_to_first_token_seconds_sum\{[^}]*\} (\S+)$", re.M)


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name")), "unknown")


def default_model(folder: Path) -> tuple[Path, str, str, str]:
    """The tiny tool caller, and the system prompt, task and tool result it was trained on."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "server")]
    from tool_model import SYSTEM, TASK, make_tool_caller, tool_result

    return make_tool_caller(folder), SYSTEM, TASK, tool_result(0)


class StepLog:
    """Usage and server TTFT of every chat completion the framework sends."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url
        self.steps: list[dict] = []
        self._ttft_before = 0.0

    async def ttft_sum(self) -> float:
        async with httpx.AsyncClient() as c:
            text = (await c.get(self.base + "/metrics")).text
        m = TTFT_SUM.search(text)
        return float(m.group(1)) if m else 0.0

    async def on_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self._ttft_before = await self.ttft_sum()

    async def on_response(self, response: httpx.Response) -> None:
        if not response.request.url.path.endswith("/chat/completions"):
            return
        await response.aread()
        usage = json.loads(response.content)["usage"]
        self.steps.append({"prompt": usage["prompt_tokens"], "reply": usage["completion_tokens"],
                           "cached": usage["prompt_tokens_details"]["cached_tokens"],
                           "ttft_s": await self.ttft_sum() - self._ttft_before})


async def run_agent(base_url: str, system: str, task: str, result: str, steps: int) -> list[dict]:
    from agents import (Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, RunConfig,
                        Runner, set_tracing_disabled)
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    log = StepLog(base_url)
    http = httpx.AsyncClient(timeout=600, event_hooks={"request": [log.on_request],
                                                       "response": [log.on_response]})
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="x", http_client=http, max_retries=0)

    async def search(_ctx, _args: str) -> str:
        return result

    tool = FunctionTool(name="search", description="Search the cache docs.",
                        params_json_schema={"type": "object",
                                            "properties": {"query": {"type": "string"}},
                                            "required": ["query"]},
                        on_invoke_tool=search, strict_json_schema=False)
    agent = Agent(name="researcher", instructions=system, tools=[tool],
                  model=OpenAIChatCompletionsModel(model="agent", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    try:
        await Runner.run(agent, task, max_turns=steps, run_config=RunConfig())
    except MaxTurnsExceeded:
        pass  # the model kept calling tools: every allowed step ran
    await http.aclose()
    return log.steps


def report(runs: list[list[dict]], page: int) -> dict:
    rows = []
    for k in range(max(len(r) for r in runs)):
        at = [r for r in runs if len(r) > k]
        ideal = [0 if k == 0 else min(r[k]["prompt"] - 1, (r[k - 1]["prompt"] + r[k - 1]["reply"])
                                      // page * page) for r in at]
        cached = [r[k]["cached"] for r in at]
        ttft = sorted(r[k]["ttft_s"] for r in at)
        rows.append({"step": k + 1, "prompt_tokens": at[0][k]["prompt"], "cached": cached[0],
                     "ideal_cached": ideal[0],
                     "hit_vs_ideal": round(sum(cached) / sum(ideal), 4) if sum(ideal) else None,
                     "ttft_ms_median": round(1000 * ttft[len(ttft) // 2], 2)})
    total_cached = sum(s["cached"] for r in runs for s in r[1:])
    total_ideal = sum(row["ideal_cached"] for row in rows[1:]) * len(runs)
    return {"steps": rows, "hit_vs_ideal_after_step_1": round(total_cached / total_ideal, 4)
            if total_ideal else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF folder or .gguf (default: the tiny tool caller)")
    ap.add_argument("--chat-template", default=None, help="a template that renders tools")
    ap.add_argument("--steps", type=int, default=8, help="model calls per agent run")
    ap.add_argument("--runs", type=int, default=3, help="agent runs, each from an empty cache")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="one run of 4 model calls")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.steps = 1, 4

    from deepinfer.config import EngineConfig
    from deepinfer.engine import LLMEngine
    from deepinfer.server.serve import BackgroundServer
    from deepinfer.server.config import ServerConfig, read_chat_template

    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-agent-bench-"))
    system, task, result = "You are a helpful agent.", "How does prefix caching work?", "ok"
    model = args.model
    if model is None:
        model, system, task, result = default_model(tmp / "model")
    engine = LLMEngine(EngineConfig(model=str(model), page_size=args.page_size, host_cache_gb=0.0,
                                    enable_disk_cache=False, progress=False))  # L1 only
    cfg = ServerConfig(port=0, log_level="warning", served_model_name="agent",
                       chat_template=read_chat_template(args.chat_template))
    runs = []
    with BackgroundServer(engine, cfg) as srv:
        for i in range(args.runs):
            srv.async_engine.call_sync(lambda: engine.kv.evict())  # each run starts cold
            t0 = time.perf_counter()
            steps = asyncio.run(run_agent(srv.url, system, task, result, args.steps))
            print(f"run {i + 1}: {len(steps)} model calls in {time.perf_counter() - t0:.2f}s",
                  file=sys.stderr)
            runs.append(steps)
    out = {"cpu": cpu_name(), "model": str(args.model or "tiny tool caller (tests/server)"),
           "page_size": args.page_size, "runs": args.runs, **report(runs, args.page_size)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
