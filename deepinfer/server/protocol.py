"""Request parsing and validation for the OpenAI/DeepSeek-compatible endpoints.

Requests are checked field by field by hand (not by a schema library) so every error names
the offending field, OpenAI style::

    {"error": {"message": "max_tokens: must be an integer >= 1, got -3",
               "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Unknown fields are ignored, as vLLM does. Fields we cannot honour (``echo``,
``suffix``) are rejected with 400 rather than silently ignored. Tool fields are checked in
``tools/request.py``.

Before any field is read, the whole body is checked: JSON nested at most ``MAX_JSON_DEPTH``
deep, integers of at most 4,300 digits (Python's own bound), and every string (keys too)
valid Unicode, i.e. without lone surrogates, which JSON's ``\\ud800`` escapes can carry. The
value ranges are those of ``deepinfer/limits.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..limits import INT64_MAX, INT64_MIN, SEED_MAX, SEED_MIN, encodable, is_int
from ..sampling_params import SamplingParams
from ..structured.spec import StructuredOutput
from .cache_control import CacheBreakpoint
from .thinking import Thinking, parse_thinking
from .tools.request import ToolRequest, parse_tool_request, tool_message_fields


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest)
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_request_error(cls, e: RequestError, rename: dict[str, str] | None = None) -> APIError:
        name = (rename or {}).get(e.field, e.field)
        return cls(e.status, f"{name}: {e.message}", param=name)


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def parse_json_body(raw: bytes) -> dict:
    if not raw.strip():
        raise bad(None, "the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(None, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") \
            from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an int of > 4300 digits
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    check_json_values(body)
    return body


def check_json_values(body: dict) -> None:
    """Depth bound and valid Unicode for the whole body; the error names the first bad path."""
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            if not encodable(v):
                raise bad(path or None, "must be valid Unicode text (it contains a lone "
                                        "surrogate)")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(path or None, f"the request body is nested more than {MAX_JSON_DEPTH} "
                                    "levels deep")
        if isinstance(v, dict):
            for k, x in v.items():
                where = f"{path}.{k}" if path else k
                if not encodable(k):
                    raise bad(path or None, "field names must be valid Unicode text")
                stack.append((x, where, depth + 1))
        else:
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)
                         if isinstance(x, (str, dict, list)))


# ---------------------------------------------------------------------- field readers
def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def get_int(body: dict, name: str, default: int | None = None, lo: int = INT64_MIN,
            hi: int = INT64_MAX) -> int | None:
    """An integer field; within int64 unless ``lo``/``hi`` say otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise bad(name, f"must be an integer, got {_shown(v)}")
    return _in_range(name, v, lo, hi)


def get_num(body: dict, name: str, default: float | None = None, lo: float | None = None,
            hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(name, f"must be a number, got {_shown(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond the float range
        raise bad(name, f"must be a finite number, got {_shown(v)}") from None
    if not math.isfinite(f):
        raise bad(name, f"must be a finite number, got {_shown(v)}")
    return float(_in_range(name, f, lo, hi))


def _in_range(name: str, v, lo, hi):
    if lo is not None and v < lo:
        raise bad(name, f"must be >= {lo}, got {_shown(v)}")
    if hi is not None and v > hi:
        raise bad(name, f"must be <= {hi}, got {_shown(v)}")
    return v


def _shown(v: Any) -> str:
    """A bad value for an error message, bounded in length (and cheap for huge integers)."""
    if is_int(v) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    r = json.dumps(v) if isinstance(v, (int, float, bool, type(None))) else ascii(v)
    return r if len(r) <= 80 else r[:77] + "..."


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {_shown(v)}")
    return v


def get_str(body: dict, name: str, default: str | None = None,
            nonempty: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(name, f"must be a string, got {_shown(v)}")
    if nonempty and not v:
        raise bad(name, "must not be empty")
    return v


def get_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "must be a string or an array of strings")
    if any(not s for s in v):
        raise bad("stop", "stop strings must not be empty")
    return v


def _reject_unsupported(body: dict, chat: bool) -> None:
    if not chat:
        if get_bool(body, "echo"):
            raise bad("echo", "is not supported")
        if body.get("suffix") not in (None, ""):
            raise bad("suffix", "is not supported")


def get_logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias``: {"token id as a string": bias in [-100, 100]}."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias", "must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 19):
            raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {k!r}")
        if not _is_num(b) or not -100 <= b <= 100:
            raise bad("logit_bias", f"biases must be numbers in [-100, 100], got {_shown(b)}")
        out[int(k)] = float(b)
    return out


def get_response_format(body: dict) -> StructuredOutput | None:
    """``response_format``: text (no constraint), json_object, or json_schema (strict or not:
    the schema is enforced either way)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("response_format", "must be an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind != "json_schema":
        raise bad("response_format", f"type must be text, json_object or json_schema, "
                                     f"got {json.dumps(kind)}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", "must be an object with a 'schema'")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "must be a JSON schema object")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    try:
        return StructuredOutput.json_schema(schema)
    except RequestError as e:
        raise bad("response_format.json_schema.schema", e.message) from None


# ---------------------------------------------------------------------- messages
def normalize_messages(v: Any) -> list[dict]:
    """Check chat messages and reduce each to ``{"role", "content"}`` with text content (plus
    the tool fields: an assistant's ``tool_calls``, a tool result's ``tool_call_id``)."""
    if not isinstance(v, list):
        raise bad("messages", "must be an array of message objects")
    if not v:
        raise bad("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role", "must be a non-empty string")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(sorted(ROLES))}, got "
                                       f"{_shown(role)}")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise bad(f"{where}.content", "is required")
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", "
                              "\"text\": ...}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or an array of text parts")
        try:
            tools = tool_message_fields(m, where)
        except RequestError as e:
            raise APIError.from_request_error(e) from None
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            tools["reasoning_content"] = m["reasoning_content"]  # DeepSeek: a tool loop's reasoning
        out.append({"role": role, "content": content, **tools})
    return out


# ---------------------------------------------------------------------- requests
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
