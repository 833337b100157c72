"""Speculation counters reach the client: a ``speculative`` object in the response usage
(streamed or not), and ``/metrics`` series labelled by draft source."""

import json
import sys
from pathlib import Path

import httpx
import pytest

from deepinfer.spec.config import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))  # the server helpers
from server_helpers import no_lower_tiers, start_server  # noqa: E402
from test_spec_engine import prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def spec_server(tiny_llama):
    srv = start_server(tiny_llama, engine_kw=dict(
        speculative_config=SpeculativeConfig(method="ngram", num_tokens=3, scheduled=False), threads=1,
        **no_lower_tiers()))
    yield srv
    srv.stop()


def metric_values(url: str, name: str) -> dict[str, float]:
    """``deepinfer:NAME`` series by their ``source`` label."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"deepinfer:{name}{{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('source="')[1].split('"')[0]] = float(value)
    return out


def test_usage_and_metrics_carry_the_speculation_counters(spec_server):
    url = spec_server.url
    body = {"prompt": prompts(1, 14, seed=21)[0], "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}
    usage = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
    s = usage["speculative"]
    assert s["source"] == "ngram"
    assert s["drafted_tokens"] >= s["verified_tokens"] >= s["accepted_tokens"] > 0
    assert s["mean_accepted_tokens"] == pytest.approx(s["accepted_tokens"] / s["verify_steps"],
                                                      abs=1e-4)
    # each verify step emits its accepted draft tokens plus one; the first token is the prefill's
    assert s["accepted_tokens"] + s["verify_steps"] <= usage["completion_tokens"] - 1
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = chunks[-1]["usage"]["speculative"]
    # (its prompt hits the cache up to its last token, so its first token can be drafted too)
    assert streamed["source"] == "ngram" and streamed["accepted_tokens"] > 0
    total = {k: s[k] + streamed[k] for k in ("accepted_tokens", "verified_tokens", "drafted_tokens")}
    assert metric_values(url, "spec_accepted_tokens_total") == {"ngram": total["accepted_tokens"]}
    assert metric_values(url, "spec_verified_tokens_total") == {"ngram": total["verified_tokens"]}
    assert metric_values(url, "spec_drafted_tokens_total") == {"ngram": total["drafted_tokens"]}
    assert set(metric_values(url, "spec_calibration_ece")) == {"ngram"}


def test_plain_requests_have_no_speculative_usage(spec_server):
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    usage = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert "speculative" not in usage  # logprobs read more than logits: never speculated
