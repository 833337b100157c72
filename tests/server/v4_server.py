"""The live DeepSeek-V4 server the grammar tests (forced calls, ``response_format``) share."""

from __future__ import annotations

import openai
import pytest
from deepseek_tiny import make_v4_checkpoint
from server_helpers import start_server


def v4_server_fixtures(folder: str, timeout: float = 120):
    """Module fixtures ``srv``, a server over a fresh tiny DeepSeek-V4 checkpoint in a temporary
    ``folder`` (room for tool schemas in the prompt), and ``client``, the official client on it.
    Use: ``srv, client = v4_server_fixtures("tiny_v4_x")`` at a test module's top level."""

    @pytest.fixture(scope="module")
    def srv(tmp_path_factory):
        s = start_server(make_v4_checkpoint(tmp_path_factory.mktemp(folder)),
                         engine_kw=dict(max_model_len=2048, max_num_batched_tokens=2048))
        yield s
        s.stop()

    @pytest.fixture(scope="module")
    def client(srv):
        return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                             timeout=timeout)

    return srv, client
