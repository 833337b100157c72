"""A live server on a loopback port (uvicorn in a thread) over the tiny random Llama."""

from __future__ import annotations

import openai
import pytest
from server_helpers import start_server


@pytest.fixture(scope="session")
def server(tiny_llama):
    srv = start_server(tiny_llama)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def model_name(server):
    return server.server_obj.model_name


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture()
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=120)
