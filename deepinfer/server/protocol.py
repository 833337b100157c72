"""A request to ``/v1/chat/completions`` or ``/v1/completions``, parsed into ``ParsedRequest``.

Unknown fields are ignored, as vLLM does. Fields we cannot honour (``echo``, ``suffix``) are
rejected with 400 rather than silently ignored. The body was checked as a whole first
(``json_body.py``); each field is read by ``request_fields.py``, chat messages by
``chat_messages.py`` and the tool fields by ``tools/request.py``; every error is an
``APIError`` (``api_error.py``) that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..limits import INT64_MAX, SEED_MAX, SEED_MIN, is_int
from ..sampling_params import SamplingParams
from .api_error import APIError, bad
from .cache_control import CacheBreakpoint
from .chat_messages import normalize_messages
from .request_fields import (get_bool, get_int, get_logit_bias, get_num, get_response_format,
                             get_stop, get_str)
from .thinking import Thinking, parse_thinking
from .tools.request import ToolRequest, parse_tool_request

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest)


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    params: SamplingParams  # max_tokens is a placeholder when ``max_tokens`` is None
    max_tokens: int | None  # None (chat only): the rest of the context
    max_tokens_field: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    structured_field: str = "response_format"  # the request field its constraint came from
    cache_salt: str | None = None
    user: str | None = None
    want_logprobs: bool = False  # chat: logprobs=true; completion: logprobs=k given
    tools: ToolRequest = field(default_factory=ToolRequest)
    tool_call_prefix: str = "call_"  # ids of parsed tool calls (the Anthropic API: "toolu_")
    cache_breakpoints: list[CacheBreakpoint] = field(default_factory=list)  # Anthropic API
    thinking: Thinking = field(default_factory=Thinking)  # read by the DeepSeek-V4 encoding
    response_format: dict | None = None  # as sent: the DeepSeek-V4 encoding renders it

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def tool_request(body: dict) -> ToolRequest:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` (``tools/request.py``); 400 if bad."""
    return _request_field(parse_tool_request, body)


def _request_field(parse, body: dict):
    try:
        return parse(body)
    except RequestError as e:
        raise APIError.from_request_error(e) from None


def parse_prompt(v: Any) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "must not be empty")
        return v
    if isinstance(v, list):
        if not v:
            raise bad("prompt", "must not be empty")
        if all(is_int(t) for t in v):
            if not all(0 <= t <= INT64_MAX for t in v):
                raise bad("prompt", "token ids must be non-negative 64-bit integers")
            return list(v)
        if all(isinstance(t, (str, list)) for t in v):
            raise bad("prompt", "batched prompts are not supported; send one prompt per request")
        raise bad("prompt", "must be a string or an array of integer token ids")
    if v is None:
        raise bad("prompt", "is required")
    raise bad("prompt", "must be a string or an array of integer token ids")


def _reject_unsupported(body: dict, chat: bool) -> None:
    if not chat:
        if get_bool(body, "echo"):
            raise bad("echo", "is not supported")
        if body.get("suffix") not in (None, ""):
            raise bad("suffix", "is not supported")


def parse_request(body: dict, kind: str, defaults: dict | None = None) -> ParsedRequest:
    """``defaults``: request defaults from ``--generation-config`` (field -> value)."""
    chat = kind == "chat"
    defaults = defaults or {}
    model = get_str(body, "model")
    tools = ToolRequest()
    if chat:
        messages = normalize_messages(body.get("messages"))
        prompt = None
        tools = tool_request(body)
        if tools.forced and body.get("response_format") not in (None, {"type": "text"}):
            raise bad("tool_choice", f"{json.dumps(body['tool_choice'])} cannot be combined "
                                     "with response_format: the reply must be tool calls")
    else:
        messages = None
        prompt = parse_prompt(body.get("prompt"))
    n = get_int(body, "n", 1, lo=1)
    if tools.tools and n > 1:
        raise bad("n", "tools are supported with n=1 only")
    best_of = None if chat else get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of < n:
        raise bad("best_of", f"must be >= n ({n}), got {best_of}")
    _reject_unsupported(body, chat)

    max_tokens = get_int(body, "max_tokens")
    mt_field = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = get_int(body, "max_completion_tokens")
        mt_field = "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad(mt_field, f"must be an integer >= 1, got {max_tokens}")
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens", None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)

    if chat:
        want = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", None, lo=0, hi=20)
        if top is not None and top > 0 and not want:
            raise bad("top_logprobs", "requires logprobs to be true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = get_int(body, "logprobs", None, lo=0, hi=20)
        want = logprobs is not None
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t <= INT64_MAX
                                                 for t in stop_ids):
        raise bad("stop_token_ids", "must be an array of non-negative 64-bit integers")
    params_kw = dict(
        max_tokens=max_tokens or 1,
        temperature=get_num(body, "temperature", defaults.get("temperature", 1.0)),
        top_p=get_num(body, "top_p", defaults.get("top_p", 1.0)),
        top_k=get_int(body, "top_k", defaults.get("top_k", 0)),
        min_p=get_num(body, "min_p", defaults.get("min_p", 0.0)),
        seed=get_int(body, "seed", lo=SEED_MIN, hi=SEED_MAX),
        stop=get_stop(body),
        stop_token_ids=list(stop_ids),
        ignore_eos=get_bool(body, "ignore_eos"),
        logprobs=logprobs,
        presence_penalty=get_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=get_num(body, "repetition_penalty", 1.0),
        logit_bias=get_logit_bias(body),
        n=n,
        best_of=best_of if best_of is not None and best_of > n else None,
        structured_output=get_response_format(body),
    )
    try:
        params = SamplingParams(**params_kw)
    except RequestError as e:
        raise APIError.from_request_error(e, {"max_tokens": mt_field, "logprobs": (
            "top_logprobs" if chat else "logprobs"), "structured_output": "response_format"}
        ) from None
    stream = get_bool(body, "stream")
    if stream and params.best_of is not None:
        raise bad("best_of", "cannot be combined with stream (the best samples are known only "
                             "at the end)")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "must be an object")
        include_usage = get_bool(so, "include_usage")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("cache_salt", "must be a non-empty string")
    return ParsedRequest(kind=kind, model=model, params=params, max_tokens=max_tokens,
                         max_tokens_field=mt_field, messages=messages, prompt=prompt,
                         stream=stream, include_usage=include_usage, cache_salt=salt,
                         user=get_str(body, "user"), want_logprobs=want, tools=tools,
                         structured_field="tool_choice" if tools.forced else "response_format",
                         thinking=_request_field(parse_thinking, body) if chat else Thinking(),
                         response_format=body.get("response_format") if chat else None)
