"""The official openai client against a live server: chat and completions, streamed or not."""

import httpx
import pytest

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def check_usage(u, completion_tokens=None):
    extra = u.model_extra
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    hit, miss = extra["prompt_cache_hit_tokens"], extra["prompt_cache_miss_tokens"]
    assert hit + miss == u.prompt_tokens and hit >= 0 and miss >= 1
    assert u.prompt_tokens_details.cached_tokens == hit
    by_tier = u.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == hit
    if completion_tokens is not None:
        assert u.completion_tokens == completion_tokens


def test_chat_nonstream_and_stream_agree(client, model_name):
    msgs = [{"role": "user", "content": "hello world, how are you today?"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, **GREEDY)
    assert r.object == "chat.completion" and r.model == model_name
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    check_usage(r.usage, 8)

    chunks = list(client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # OpenAI's usage chunk
    check_usage(chunks[-1].usage, 8)
    # the same prompt again: all but the last page is served from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 4


def test_stream_without_include_usage_still_reports_usage(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "caching saves compute"}],
        max_tokens=3, stream=True, **GREEDY))
    assert all(c.choices for c in chunks)  # no usage-only chunk
    assert chunks[-1].choices[0].finish_reason == "length"
    check_usage(chunks[-1].usage, 3)  # DeepSeek style: usage on the last choice chunk


@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over", [5, 17, 42, 99, 7, 8, 9]])
def test_completions_text_and_token_ids(client, model_name, prompt):
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    check_usage(r.usage, 6)
    if isinstance(prompt, list):
        assert r.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    check_usage(chunks[-1].usage, 6)


def test_logprobs_chat_and_completion(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy: the best one
    c = client.completions.create(model=model_name, prompt="hello", max_tokens=3, logprobs=2,
                                  **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0


def test_stop_string_does_not_leak_into_stream(client, model_name):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, **GREEDY)
    text = full.choices[0].text
    i = next(i for i in range(len(text) // 3, len(text) - 2)
             if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop = text[i:i + 2]
    want = text[: text.find(stop)]
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=16,
                                            stop=[stop], stream=True, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == want and stop not in streamed
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, stop=stop,
                                  **GREEDY)
    assert r.choices[0].text == want


def test_seeded_sampling_is_reproducible(client, model_name):
    kw = dict(model=model_name, prompt="hello world", max_tokens=8, temperature=1.0, top_p=0.9,
              seed=7, extra_body={"ignore_eos": True, "top_k": 40, "min_p": 0.01})
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_models_health_metrics(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prefix_cache_hits_by_tier_total", "num_requests_running",
                 "num_requests_waiting", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_count", "chat_history_rewrites_total"):
        assert f"deepinfer:{name}" in text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    queries = values["deepinfer:prefix_cache_queries_total"]
    assert queries >= values["deepinfer:prefix_cache_hits_total"] > 0
    assert values["deepinfer:compute_threads"] >= 1 and values["deepinfer:other_processes_cores"] >= 0
