"""Many clients at once, disconnects, back-pressure and graceful shutdown."""

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
from hang_up import hang_up_mid_stream
from server_helpers import start_server, wait_idle


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"deepinfer:{name}{{") or line.startswith(f"deepinfer:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_16_concurrent_streams_and_a_disconnect_frees_its_pages(server, aclient, model_name):
    aborted_before = metric(server.url, "requests_aborted_total")

    async def one(i: int) -> tuple[str, object]:
        stream = await aclient.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"client {i}: hello world"}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage = [], None
        async for c in stream:
            if c.choices:
                text.append(c.choices[0].delta.content or "")
            if c.usage:
                usage = c.usage
        return "".join(text), usage

    async def main():
        return await asyncio.gather(hang_up_mid_stream(aclient, model_name, 400),
                                    *(one(i) for i in range(16)))

    got, *results = asyncio.run(main())
    assert got == 3
    for text, usage in results:
        assert usage.completion_tokens == 12
        hit = usage.model_extra["prompt_cache_hit_tokens"]
        assert hit + usage.model_extra["prompt_cache_miss_tokens"] == usage.prompt_tokens
    wait_idle(server)  # every page of the aborted request is free or (unlocked) cache
    assert metric(server.url, "requests_aborted_total") == aborted_before + 1
    # batched answers equal one-at-a-time answers
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    alone = c.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "client 3: hello world"}],
        max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert alone.choices[0].message.content == results[3][0]


def test_back_pressure_answers_429_then_recovers(tiny_llama):
    srv = start_server(tiny_llama, engine_kw=dict(max_num_seqs=1), max_queue=1)
    body = {"prompt": "hello world", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as hc:
            async with hc.stream("POST", "/v1/completions", json=body) as a:
                assert a.status_code == 200
                lines = a.aiter_lines()
                while not (await lines.__anext__()).startswith("data:"):
                    pass  # a is running
                async with hc.stream("POST", "/v1/completions", json=body) as b:
                    assert b.status_code == 200  # b waits in the queue
                    r = await hc.post("/v1/completions", json={**body, "stream": False})
                    assert r.status_code == 429
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
            # both clients hung up: once the server has noticed, the engine is free again
            await asyncio.to_thread(wait_idle, srv)
            r = await hc.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    try:
        asyncio.run(main())
        wait_idle(srv)
        assert metric(srv.url, "requests_rejected_total") == 1
    finally:
        srv.stop()


def test_graceful_shutdown_drains_running_requests_and_flushes(tiny_llama):
    srv = start_server(tiny_llama)
    flushed = []
    eng = srv.async_engine.engine
    real = getattr(eng, "shutdown", None)

    def shutdown(*a, **kw):
        flushed.append(True)
        return real(*a, **kw) if real else True

    eng.shutdown = shutdown
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model=srv.server_obj.model_name, prompt="hello", max_tokens=40,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)  # running
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    time.sleep(0.3)
    rest = list(it)  # the request runs to its end while the server shuts down
    assert rest[-1].choices[0].finish_reason == "length"
    assert rest[-1].usage.completion_tokens == 40
    stopper.join(30)
    assert not stopper.is_alive() and not srv.async_engine.alive
    assert flushed == [True]


def test_non_streaming_client_that_hangs_up_is_aborted(server):
    before = metric(server.url, "requests_aborted_total")
    body = json.dumps({"prompt": list(range(60, 100)), "max_tokens": 470, "temperature": 0,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    ae = server.async_engine
    t0 = time.monotonic()
    while ae.call_sync(ae.kv_snapshot)["live_requests"] == 0:  # wait until it runs
        assert time.monotonic() - t0 < 120
        time.sleep(0.005)
    sock.close()  # hang up without reading the answer
    wait_idle(server)
    assert metric(server.url, "requests_aborted_total") == before + 1
