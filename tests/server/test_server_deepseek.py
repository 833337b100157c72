"""A live server over a tiny DeepSeek-V4 checkpoint: the recipe is chosen from the checkpoint,
replies carry ``reasoning_content`` (streamed deltas add up to the non-streamed reply), and a
multi-turn tool-enabled chat extends each turn token for token, so every turn hits the cache."""

from __future__ import annotations

import argparse

import openai
import pytest
from deepseek_tiny import SPECIALS, make_v4_checkpoint
from server_helpers import PAGE, start_server
from test_deepseek_encoding import WEATHER
from transformers import AutoTokenizer

from deepinfer.server.config import add_server_args

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_server"))


@pytest.fixture(scope="module")
def srv(ckpt):
    s = start_server(ckpt, engine_kw=dict(max_model_len=2048, max_num_batched_tokens=2048))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_text(ckpt) -> dict[str, int]:
    """logit_bias keeping the random model to plain, valid UTF-8 text (no role or end tokens,
    no lone bytes of a multi-byte character), as a trained model writes."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    banned = {tok.convert_tokens_to_ids(s) for s in SPECIALS}
    banned |= {i for i in range(len(tok)) if "\ufffd" in tok.decode([i])}
    return {str(i): -100 for i in sorted(banned)}


def test_reasoning_content_streamed_equals_nonstreamed(srv, client):
    assert srv.server_obj.async_engine.replies.recipe is not None  # chosen from the checkpoint
    kw = dict(model=srv.server_obj.model_name, temperature=0, max_tokens=24,
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert isinstance(msg.reasoning_content, str)  # thinking is on by default, as DeepSeek's API
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == (msg.content or "")
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason

    off = client.chat.completions.create(**kw, extra_body={"thinking": {"type": "disabled"}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_tool_chat_turns_extend_and_hit_the_cache(srv, client, plain_text):
    """Thinking off, tools given: each reply is sent back as returned, and the next prompt is
    the previous prompt + the generated ids + the new turn ("extended"), cached up to the last
    full page of the previous turn."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prev = None
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=srv.server_obj.model_name, messages=messages, tools=[WEATHER], temperature=0,
            max_tokens=8, logit_bias=plain_text, extra_body={"thinking": {"type": "disabled"}})
        r = raw.parse()
        u = r.usage
        if prev is not None:
            assert raw.headers["x-deepinfer-prompt-encoding"] == "extended"
            assert u.prompt_tokens_details.cached_tokens >= (prev - 1) // PAGE * PAGE
        prev = u.prompt_tokens + u.completion_tokens
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"And in {turn + 1} days?"}]


def test_official_api_rejections_are_400s(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=srv.server_obj.model_name, messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER], tool_choice="required", max_tokens=4)
    assert e.value.body["param"] == "tool_choice"  # no forced calls in thinking mode


def test_deepseek_v4_is_a_tool_call_parser_choice():
    p = argparse.ArgumentParser()
    add_server_args(p)
    assert p.parse_args(["--tool-call-parser", "deepseek_v4"]).tool_call_parser == "deepseek_v4"
