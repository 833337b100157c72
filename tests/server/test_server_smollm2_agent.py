"""The embedded SmolLM2 behind both clients, with a tool-rendering chat template
(``--chat-template``): usage adds up, cache marks are reported, and an agent's next turn
(whatever the model answered: text or a tool call) extends the previous one in the cache."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from deepinfer.config import EngineConfig
from deepinfer.engine import LLMEngine
from deepinfer.server.serve import BackgroundServer
from deepinfer.server.config import ServerConfig
from server_helpers import no_lower_tiers
from tool_model import HERMES_TOOLS_TEMPLATE, TOOLS

PAGE = 16
SYSTEM = "You are a research agent. Use the search tool when you need facts."


@pytest.fixture(scope="module")
def smol():
    try:
        engine = LLMEngine(EngineConfig(model=None, page_size=PAGE, max_model_len=2048,
                                        progress=False, **no_lower_tiers()))
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    cfg = ServerConfig(port=0, log_level="warning", chat_template=HERMES_TOOLS_TEMPLATE)
    with BackgroundServer(engine, cfg) as srv:
        yield srv


def test_openai_tool_turns_extend_in_the_cache(smol):
    c = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Search for how a radix tree caches prefixes."}]
    r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                  tools=TOOLS, temperature=0, max_tokens=24)
    msg = r.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                         "content": "A radix tree shares common prefixes between keys."})
    else:
        messages.append({"role": "user", "content": "Go on."})
    raw = c.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS, temperature=0,
        max_tokens=4)
    nxt = raw.parse()
    assert raw.headers["x-deepinfer-prompt-encoding"] == "extended"
    prev = r.usage.prompt_tokens + r.usage.completion_tokens
    assert nxt.usage.prompt_tokens_details.cached_tokens >= prev // PAGE * PAGE - PAGE


def test_anthropic_usage_adds_up_and_marks_are_cached(smol):
    c = anthropic.Anthropic(base_url=smol.url, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    usages = []
    for question in ("What is a page table?", "What is a radix tree?"):
        r = c.messages.create(model="SmolLM2-135M-Instruct", max_tokens=8, system=system, tools=tools,
                              messages=[{"role": "user", "content": question}],
                              extra_body={"temperature": 0, "cache_salt": "anthropic"})
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": question}], "tools": TOOLS}
        n_prompt = httpx.post(smol.url + "/tokenize", json=body).json()["count"]
        u = r.usage
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens \
            == n_prompt
        usages.append(u)
    first, second = usages
    assert first.cache_creation_input_tokens > 0
    # the second question shares the system + tools prefix the first one's mark cached
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
