"""Prefix-stable chat encoding: turn k's prompt + reply + turn-end tokens prefix turn k+1's."""

import shutil

import httpx
import openai
import pytest
from server_helpers import PAGE, start_server
from transformers import AutoTokenizer

from deepinfer.chat import render_text
from deepinfer.server.prompts import PromptBuilder

# Drops the reasoning of earlier replies, as several reasoning models' templates do.
DROP_THINK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites the first turn according to the length of the conversation.
COUNTING = (
    "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_multi_turn_conversation_hits_the_cache(client, model_name):
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "hello world, how are you today?"}]
    prev = None
    for turn in range(5):
        kw = dict(model=model_name, messages=msgs, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
        if turn % 2:  # streamed turns: the reply text is what the chunks add up to
            raw = client.chat.completions.with_raw_response.create(
                stream=True, stream_options={"include_usage": True}, **kw)
            chunks = list(raw.parse())
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            raw = client.chat.completions.with_raw_response.create(**kw)
            r = raw.parse()
            reply, usage = r.choices[0].message.content, r.usage
        hit = usage.model_extra["prompt_cache_hit_tokens"]
        assert hit + usage.model_extra["prompt_cache_miss_tokens"] == usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == hit
        if prev is not None:
            assert raw.headers["x-deepinfer-prompt-encoding"] == "extended"
            assert raw.headers["x-deepinfer-history-rewritten"] == "false"
            # previous prompt + previous reply are cached, up to one page
            assert hit >= prev[0] + prev[1] - PAGE, (turn, hit, prev)
        prev = (usage.prompt_tokens, usage.completion_tokens)
        msgs = msgs + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": f"and what about number {turn}?"}]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def remember(b, built, reply_ids, content):
    b.remember(built.key_state, built.token_ids, reply_ids,
               {"role": "assistant", "content": content})


def test_extension_keeps_generated_ids_that_retokenise_differently(tok):
    b = PromptBuilder(tok, {tok.eos_token_id}, 10_000)
    m1 = [{"role": "user", "content": "hello world"}]
    t1 = b.chat(m1, None)
    assert t1.encoding == "rendered"
    # a reply generated one character at a time: its text tokenises to different ids
    reply = [tok.convert_tokens_to_ids(c) for c in "fine"] + [tok.eos_token_id]
    content = tok.decode(reply, skip_special_tokens=True)
    assert tok.encode(content, add_special_tokens=False) != reply[:-1]
    remember(b, t1, reply, content)
    m2 = m1 + [{"role": "assistant", "content": content}, {"role": "user", "content": "thanks"}]
    t2 = b.chat(m2, None)
    assert t2.encoding == "extended" and not t2.history_rewritten
    assert t2.token_ids[: len(t1.token_ids) + len(reply)] == t1.token_ids + reply
    assert t2.reused_tokens == len(t1.token_ids) + len(reply)
    assert tok.decode(t2.token_ids) == render_text(tok, m2)
    # another salt never sees this reply
    assert b.chat(m2, "tenant-b").encoding == "rendered"


def test_reply_cut_at_stop_string_still_extends(tok):
    b = PromptBuilder(tok, {tok.eos_token_id}, 10_000)
    m1 = [{"role": "user", "content": "hi"}]
    t1 = b.chat(m1, None)
    ids = tok.encode("I am fine, thanks.", add_special_tokens=False)
    content = "I am fine"  # the stop string ", thanks" was generated then cut
    remember(b, t1, ids, content)
    m2 = m1 + [{"role": "assistant", "content": content}, {"role": "user", "content": "ok"}]
    t2 = b.chat(m2, None)
    assert t2.encoding == "extended" and t2.reused_tokens > len(t1.token_ids)


def test_template_that_rewrites_history_is_reported(tok):
    for template, encoding in ((DROP_THINK, "extended_prompt"), (COUNTING, "rendered")):
        tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
        tok2.chat_template = template
        b = PromptBuilder(tok2, {tok2.eos_token_id}, 10_000)
        m1 = [{"role": "user", "content": "hello"}]
        t1 = b.chat(m1, None)
        content = "<think>let me see</think>hi there"
        remember(b, t1, tok2.encode(content, add_special_tokens=False), content)
        m2 = m1 + [{"role": "assistant", "content": content}, {"role": "user", "content": "bye"}]
        t2 = b.chat(m2, None)
        assert t2.history_rewritten and t2.encoding == encoding, template
        assert tok2.decode(t2.token_ids) == render_text(tok2, m2)
        if encoding == "extended_prompt":  # earlier turns render as before: their ids are kept
            assert t2.token_ids[: len(t1.token_ids)] == t1.token_ids


def test_smollm2_template_renders_next_turn_as_an_extension():
    from deepinfer.loader import load_checkpoint

    try:
        ckpt = load_checkpoint(None, progress=False)
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    tok = ckpt.tokenizer
    b = PromptBuilder(tok, ckpt.eos_token_ids, 100_000)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    replies = ["The capital of France is Paris.", "Berlin is the capital of Germany."]
    built = b.chat(msgs, None)
    for i, text in enumerate(replies):
        # generated ids: the text, one token split in two (as sampling may produce), then EOS
        ids = tok.encode(text, add_special_tokens=False)
        first = tok.decode(ids[:1])
        split = [tok.convert_tokens_to_ids(t) for t in tok.tokenize(first[:1])] + \
            [tok.convert_tokens_to_ids(t) for t in tok.tokenize(first[1:])]
        if tok.decode(split) == first:
            ids = split + ids[1:]
        reply = ids + [ckpt.eos_token_ids[0]]
        content = tok.decode(reply, skip_special_tokens=True)
        remember(b, built, reply, content)
        msgs = msgs + [{"role": "assistant", "content": content},
                       {"role": "user", "content": f"And question {i + 2}?"}]
        nxt = b.chat(msgs, None)
        assert nxt.encoding == "extended" and not nxt.history_rewritten
        assert nxt.token_ids[: len(built.token_ids) + len(reply)] == built.token_ids + reply
        assert tok.decode(nxt.token_ids) == render_text(tok, msgs)
        built = nxt


def test_history_rewrite_reported_over_http(tiny_llama, tmp_path):
    path = tmp_path / "rewriting"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(DROP_THINK)
    srv = start_server(path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        eng = srv.async_engine
        msgs = [{"role": "user", "content": "think first"}]
        reply = "<think>let me see</think>ok"

        def generated() -> None:  # as if the model had written that reply to ``msgs``
            built = eng.builder.chat(msgs, None)
            eng.builder.remember(built.key_state, built.token_ids,
                                 eng.tokenizer.encode(reply, add_special_tokens=False),
                                 {"role": "assistant", "content": reply})

        eng.call_sync(generated)
        raw = c.chat.completions.with_raw_response.create(
            model="rewriting", max_tokens=2, temperature=0,
            messages=msgs + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": "next"}])
        assert raw.headers["x-deepinfer-history-rewritten"] == "true"
        assert raw.headers["x-deepinfer-prompt-encoding"] == "extended_prompt"
        text = httpx.get(srv.url + "/metrics").text
        assert 'deepinfer:chat_history_rewrites_total{model_name="rewriting"} 1' in text
    finally:
        srv.stop()
