"""Engine faults seen from the HTTP side: a request failed alone is a 500 for it only; steps
that keep failing flip /health to 503 until one succeeds."""

import httpx
import pytest
from server_helpers import start_server, wait_idle

from deepinfer.sampling_params import SamplingParams

COMP = "/v1/completions"


@pytest.fixture()
def srv(tiny_llama):
    s = start_server(tiny_llama)
    yield s
    s.stop()


def greedy(hc, prompt, n=16):
    r = hc.post(COMP, json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(hc, name):
    for line in hc.get("/metrics").text.splitlines():
        if line.startswith(f"deepinfer:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_a_request_failed_inside_the_engine_is_a_500_for_it_alone(srv, monkeypatch):
    with httpx.Client(base_url=srv.url, timeout=120) as hc:
        alone = greedy(hc, [7, 8, 9, 10, 11])
        monkeypatch.setattr(SamplingParams, "validate", lambda self: None)  # a value slips past
        with httpx.Client(base_url=srv.url, timeout=120) as other:
            body = {"prompt": [7, 8, 9, 10, 11], "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with other.stream("POST", COMP, json=body) as stream:
                bad = hc.post(COMP, json={"prompt": [3, 4], "max_tokens": 4,
                                          "temperature": 1e-300})
                text = "".join(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                               for line in stream.iter_lines() if line.startswith("data: {"))
        assert bad.status_code == 500 and "engine error" in bad.json()["error"]["message"]
        assert text == alone
        assert hc.get("/health").status_code == 200
        assert metric(hc, "request_errors_total") == 1
        assert metric(hc, "failed_requests_total") == 1
        assert srv.async_engine.engine.tiers.disk_capacity > 0  # L3 on: its losses are shown
        assert 'deepinfer:cache_disk_write_losses_by_reason_total{model_name="' in \
            hc.get("/metrics").text
    wait_idle(srv)


def test_repeated_step_failures_flip_health_until_a_step_succeeds(srv, monkeypatch):
    kv = srv.async_engine.engine.kv

    def broken():
        raise RuntimeError("injected tier failure")

    with httpx.Client(base_url=srv.url, timeout=120) as hc:
        monkeypatch.setattr(kv, "poll", broken)
        r = hc.post(COMP, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        h = hc.get("/health")
        assert h.status_code == 503 and "injected" in h.json()["error"]
        assert metric(hc, "engine_errors_total") == 2  # tried, retried once, then failed
        monkeypatch.undo()
        assert greedy(hc, "hi", 2) is not None
        assert hc.get("/health").status_code == 200
    wait_idle(srv)
