"""vLLM-style entry points: ``deepinfer serve MODEL``, --served-model-name, --chat-template,
--generation-config, ``POST /tokenize`` and ``/detokenize``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from deepinfer.cli import main
from tool_model import HERMES_TOOLS_TEMPLATE, TOOLS
from transformers import AutoTokenizer

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """``deepinfer serve MODEL`` in a subprocess with the vLLM-style flags."""
    d = tmp_path_factory.mktemp("entry")
    (d / "template.jinja").write_text(HERMES_TOOLS_TEMPLATE)
    (d / "gen").mkdir()
    (d / "gen" / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3}))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "serve", str(tiny_llama), "--port", str(port),
         "--served-model-name", "tiny-agent", "--chat-template", str(d / "template.jinja"),
         "--generation-config", str(d / "gen"), "--page-size", "4", "--num-pages", "512",
         "--max-model-len", "512", "--no-disk-cache", "--host-cache-gb", "0",
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            proc.kill()
            raise RuntimeError("deepinfer serve did not start")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(60)


def test_served_model_name_and_generation_config_defaults(served):
    assert [m["id"] for m in httpx.get(served + "/v1/models").json()["data"]] == ["tiny-agent"]
    r = httpx.post(served + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-agent", "messages": MSGS, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 3  # max_new_tokens of --generation-config
    again = httpx.post(served + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-agent", "messages": MSGS, "ignore_eos": True}).json()
    assert again["choices"][0]["message"] == r["choices"][0]["message"]  # temperature 0


def test_tokenize_uses_the_given_chat_template_with_tools(served, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    want = tok.apply_chat_template(MSGS, tools=TOOLS, chat_template=HERMES_TOOLS_TEMPLATE,
                                   tokenize=False, add_generation_prompt=True)
    r = httpx.post(served + "/tokenize", json={"messages": MSGS, "tools": TOOLS,
                                               "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(want, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    back = httpx.post(served + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == want
    text = httpx.post(served + "/tokenize", json={"prompt": "hello world",
                                                  "add_special_tokens": False}).json()
    assert text["tokens"] == tok.encode("hello world", add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
])
def test_tokenize_errors_name_the_field(served, path, body, param):
    r = httpx.post(served + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_model_given_twice_is_a_cli_error(capsys):
    assert main(["serve", "a-model", "--model", "another-model"]) == 2
    assert "given twice" in capsys.readouterr().err
