"""Streaming text (UTF-8, stop strings), Prometheus rendering, request parsing."""

import math
import re

import pytest
from transformers import AutoTokenizer

from deepinfer.server.detokenize import TextStream
from deepinfer.server.metrics import Histogram, ServerMetrics, render
from deepinfer.server.api_error import APIError
from deepinfer.server.protocol import parse_request


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_stream_never_emits_broken_utf8(tok):
    text = "héllo wörld 😀 ok ñ"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are partial characters
    s = TextStream(tok, tok.encode("prompt", add_special_tokens=False), stop=[])
    chunks = [s.push([i]) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + s.finish(text) == text


def test_stop_string_is_held_back_until_decided(tok):
    text = "the quick brown fox"
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok, [], stop=["brown", "xyz"])
    final = "the quick "  # the engine cuts the reply before the stop string
    sent = ""
    for k in range(len(ids)):
        if "brown" in tok.decode(ids[: k + 1]):
            break  # the engine stops at the token that completes the stop string
        sent += s.push([ids[k]])
        assert final.startswith(sent)  # no part of the stop string was sent
    assert sent + s.finish(final) == final


def test_prometheus_text_is_well_formed():
    m = ServerMetrics()
    for v in (0.003, 0.2, 5.0, 1e6):
        m.ttft.observe(v)
    m.tpot.observe(0.02)
    m.cached_by_tier = {"device": 30, "host": 12}
    m.finished = {"stop": 2, "length": 1}
    stats = {"prefix_cache_queries": 100, "prefix_cache_hits": 42, "running": 1, "waiting": 0,
             "hits_by_tier": {"device": 30, "host": 12}, "l2_bytes_total": 7, "name": "x"}
    text = render(stats, m, 'we"ird')
    line_re = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="([^"\\]|\\.)*",?)*\})? '
                         r'(-?[0-9.e+-]+|\+Inf|NaN)$')
    seen_types = {}
    for line in text.strip().splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            assert name not in seen_types
            seen_types[name] = kind
        elif not line.startswith("# HELP"):
            assert line_re.match(line), line
    assert seen_types["deepinfer:prefix_cache_queries_total"] == "counter"
    assert seen_types["deepinfer:num_requests_running"] == "gauge"
    assert seen_types["deepinfer:l2_bytes_total"] == "counter"
    assert 'deepinfer:hits_by_tier{model_name="we\\"ird",tier="host"} 12' in text
    assert 'deepinfer:name{' not in text  # not a number
    # the server's own per-tier hits stand in for an engine without them
    assert 'deepinfer:prefix_cache_hits_by_tier_total{model_name="we\\"ird",tier="host"} 12' in text
    # the engine's own per-tier hits win, and no name appears twice
    text2 = render({**stats, "cache_hit_tokens_by_tier": {"device": 1, "host": 0, "disk": 5}},
                   m, "x")
    assert 'deepinfer:prefix_cache_hits_by_tier_total{model_name="x",tier="disk"} 5' in text2
    assert text2.count("# TYPE deepinfer:prefix_cache_hits_by_tier_total") == 1
    buckets = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith("deepinfer:time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4
    assert 'le="+Inf"' in text and "deepinfer:time_to_first_token_seconds_count" in text


def test_histogram_buckets_are_upper_inclusive():
    h = Histogram((1.0, 2.0))
    for v in (1.0, 1.5, 2.0, 3.0, math.inf):
        h.observe(v)
    assert h.counts == [1, 2, 2]


def test_parse_request_maps_openai_fields():
    p = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
                       "max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "seed": 3,
                       "logprobs": True, "top_logprobs": 2, "stream": True,
                       "stream_options": {"include_usage": True}, "user": "u1",
                       "unknown_field": 1}, "chat")
    assert p.messages == [{"role": "user", "content": "ab"}]
    assert p.max_tokens == 5 and p.max_tokens_field == "max_completion_tokens"
    assert p.params.stop == ["x"] and p.params.seed == 3 and p.params.logprobs == 2
    assert p.stream and p.include_usage and p.user == "u1"
    q = parse_request({"prompt": [[1, 2, 3]]}, "completion")
    assert q.prompt == [1, 2, 3] and q.max_tokens == 16
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "x", "temperature": True}, "completion")
    assert e.value.param == "temperature"


def test_merged_deltas_keep_order_and_the_last_finish():
    from deepinfer.server.outputs import Delta, Usage, merge_deltas

    u = Usage(3, 2, 0)
    d = merge_deltas(Delta("a", [1], None), Delta("b", [2], None, "stop", u))
    assert (d.text, d.token_ids, d.finish_reason, d.usage, d.final) == ("ab", [1, 2], "stop", u, True)
    lp = merge_deltas(Delta("a", [1], [{"id": 1}]), Delta("", [2], [{"id": 2}])).logprobs
    assert lp == [{"id": 1}, {"id": 2}]
    assert u.to_dict()["prompt_cache_miss_tokens"] == 3
