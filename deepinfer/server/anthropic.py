"""The Anthropic Messages API, ``POST /v1/messages``, over the same engine path as chat.

A Messages request is converted to the server's normalized chat messages: ``system`` (a
string or text blocks) becomes a system message, text blocks are joined, an assistant's
``tool_use`` blocks become its ``tool_calls``, a user's ``tool_result`` blocks become ``tool``
messages. So tools are rendered by the model's own template, replies are parsed by the same
tool-call parser, and the conversation is encoded prefix-stably like any chat.

Thinking (a model whose encoding renders it: DeepSeek-V4 / V4.1): ``thinking: {"type":
"enabled", "budget_tokens": N}`` (or ``"adaptive"``) turns the model's thinking mode on,
``"disabled"`` off, absent keeps the model's default, as deepseek-recipe's own Messages
conversion does (the budget is checked, not enforced: ``max_tokens`` bounds the reply). The
reply's reasoning comes back as a ``thinking`` block before the text and ``tool_use`` blocks
(streamed as ``thinking_delta`` events, then a ``signature_delta``), and a ``thinking`` block
sent back in an assistant message is that message's reasoning, so the next prompt is built
(and prefix-stable, or reported rewritten) as on the OpenAI path with ``reasoning_content``.

``cache_control`` marks (on system blocks, tools and message blocks) are cache-unit
boundaries and pins for their TTL (``cache_control.py``). Usage adds up to the prompt:
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` = prompt tokens.
A stream's ``message_start`` carries the prompt size; the final ``message_delta`` carries the
authoritative usage (the cache hit is known only once the prompt is scheduled).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from ..errors import RequestError
from ..sampling_params import SamplingParams
from .api_error import APIError, bad
from .outputs import Delta, Usage
from .cache_control import MAX_BREAKPOINTS, TTLS, CacheBreakpoint
from .protocol import ParsedRequest, tool_request
from .request_fields import get_bool, get_int, get_num, get_response_format, get_str
from .thinking import Thinking
from .tools import ToolOutput
from .tools.stream import ReplyStream

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "abort": "end_turn"}
_RENAME = ((".function.parameters", ".input_schema"), (".function.name", ".name"),
           (".function.description", ".description"), (".function", ""))


# ---------------------------------------------------------------------- request
def _ttl(block: dict, where: str) -> float | None:
    cc = block.get("cache_control")
    if cc is None:
        return None
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise bad(f"{where}.cache_control", "must be {\"type\": \"ephemeral\"} (with an "
                                            "optional \"ttl\": \"5m\" or \"1h\")")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS:
        raise bad(f"{where}.cache_control.ttl", f"must be \"5m\" or \"1h\", got {json.dumps(ttl)}")
    return TTLS[ttl]


def _blocks(content: object, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, "must be a string or an array of content blocks")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"{where}[{i}]", "must be a content block with a 'type'")
    return content


def _text_of(b: dict, where: str) -> str:
    if not isinstance(b.get("text"), str):
        raise bad(f"{where}.text", "must be a string")
    return b["text"]


def _result_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    blocks = _blocks(content, where)
    for i, b in enumerate(blocks):
        if b["type"] != "text":
            raise bad(f"{where}[{i}].type", "only text tool results are supported")
    return "".join(_text_of(b, f"{where}[{i}]") for i, b in enumerate(blocks))


class _Converter:
    """Anthropic messages -> normalized chat messages, noting where cache marks fall."""

    def __init__(self, tools: list[dict] | None) -> None:
        self.tools = tools
        self.messages: list[dict] = []
        self.breakpoints: list[CacheBreakpoint] = []

    def mark(self, ttl: float | None, partial: dict | None) -> None:
        """A cache mark just after the block last added (``partial``: the message so far)."""
        if ttl is not None:
            msgs = self.messages + ([partial] if partial is not None else [])
            self.breakpoints.append(CacheBreakpoint([dict(m) for m in msgs], self.tools, ttl))

    def system(self, v: object) -> None:
        if v is None:
            return
        msg = {"role": "system", "content": ""}
        for i, b in enumerate(_blocks(v, "system")):
            if b["type"] != "text":
                raise bad(f"system[{i}].type", "system blocks must be text")
            msg["content"] += _text_of(b, f"system[{i}]")
            self.mark(_ttl(b, f"system[{i}]"), msg)
        self.messages.append(msg)

    def message(self, m: object, i: int) -> None:
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role", "must be \"user\" or \"assistant\"")
        role = m["role"]
        msg: dict = {"role": role, "content": ""}
        for k, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            bw = f"{where}.content[{k}]"
            t = b["type"]
            if t == "text":
                msg["content"] += _text_of(b, bw)
            elif t == "thinking" and role == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise bad(f"{bw}.thinking", "must be a string")
                msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
            elif t == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise bad(bw, "a tool_use block needs a string 'id' and 'name'")
                if not isinstance(b.get("input"), dict):
                    raise bad(f"{bw}.input", "must be an object")
                msg.setdefault("tool_calls", []).append(
                    {"id": b["id"], "type": "function",
                     "function": {"name": b["name"], "arguments": b["input"]}})
            elif t == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad(f"{bw}.tool_use_id", "must be a string")
                self.messages.append({"role": "tool", "content": _result_text(
                    b.get("content"), f"{bw}.content"), "tool_call_id": b["tool_use_id"]})
                self.mark(_ttl(b, bw), None)
                continue
            else:
                raise bad(f"{bw}.type", f"{json.dumps(t)} blocks are not supported in a "
                                        f"{role} message")
            self.mark(_ttl(b, bw), msg)
        if msg["content"] or msg.get("tool_calls") or role == "assistant":
            self.messages.append(msg)


def _tools(body: dict):
    raw = body.get("tools")
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise bad("tools", "must be an array of tools")
    converted, ttls = [], []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad(f"tools[{i}]", "must be an object with 'name' and 'input_schema'")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools[{i}].type", f"server tools ({json.dumps(t.get('type'))}) are not "
                                          "supported")
        fn = {k: v for k, v in (("name", t.get("name")), ("description", t.get("description")),
                                ("parameters", t.get("input_schema"))) if v is not None}
        converted.append({"type": "function", "function": fn})
        ttls.append(_ttl(t, f"tools[{i}]"))
    return converted, ttls


def _tool_choice(body: dict) -> dict:
    tc = body.get("tool_choice")
    if tc is None:
        return {}
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type", "must be \"auto\", \"any\", \"tool\" or \"none\"")
    out = {"parallel_tool_calls": not get_bool(tc, "disable_parallel_tool_use")}
    out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc["type"]) or \
        {"type": "function", "function": {"name": tc.get("name")}}
    return out


def _thinking(body: dict, max_tokens: int) -> Thinking:
    t = body.get("thinking")
    if t is None:
        return Thinking()
    if not isinstance(t, dict) or t.get("type") not in ("enabled", "adaptive", "disabled"):
        raise bad("thinking.type", "must be \"enabled\", \"adaptive\" or \"disabled\"")
    budget = get_int(t, "budget_tokens")
    if budget is not None and not 1 <= budget < max_tokens:
        raise bad("thinking.budget_tokens", f"must be >= 1 and less than max_tokens "
                                            f"({max_tokens})")
    return Thinking(t["type"] != "disabled")


def _output_format(body: dict) -> dict | None:
    """``output_config.format`` (what the ``anthropic`` client's ``messages.parse`` sends), as
    the OpenAI ``response_format`` that the chat path enforces."""
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise bad("output_config", "must be an object")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def parse_messages_request(body: dict, defaults: dict | None = None) -> ParsedRequest:
    defaults = defaults or {}
    tools, tool_ttls = _tools(body)
    try:
        treq = tool_request({"tools": tools or None, **_tool_choice(body)})
    except APIError as e:
        name = e.param or ""
        for ours, theirs in _RENAME:
            name = name.replace(ours, theirs)
        raise APIError(400, f"{name}: {e.message.split(': ', 1)[-1]}", param=name) from None
    conv = _Converter(treq.tools or None)
    for i, ttl in enumerate(tool_ttls):
        if ttl is not None:
            conv.breakpoints.append(CacheBreakpoint([], treq.tools[:i + 1], ttl))
    conv.system(body.get("system"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of messages")
    for i, m in enumerate(msgs):
        conv.message(m, i)
    for b in conv.breakpoints:  # a mark on tools alone renders with the first real message
        if not b.messages:
            b.messages = conv.messages[:1]
    if len(conv.breakpoints) > MAX_BREAKPOINTS:
        raise bad("cache_control", f"at most {MAX_BREAKPOINTS} blocks may have cache_control, "
                                   f"got {len(conv.breakpoints)}")
    max_tokens = get_int(body, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise bad("max_tokens", "is required and must be an integer >= 1")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop_sequences", "must be an array of non-empty strings")
    rf = _output_format(body)
    if rf is not None and treq.forced:
        raise bad("tool_choice", "a forced tool_choice cannot be combined with "
                                 "output_config.format: the reply must be tool use")
    try:
        so = get_response_format({"response_format": rf})
    except APIError as e:
        name = (e.param or "").replace("response_format.json_schema", "output_config.format")
        raise APIError(400, f"{name}: {e.message.split(': ', 1)[-1]}", param=name) from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens, structured_output=so,
            temperature=get_num(body, "temperature", defaults.get("temperature", 1.0), 0.0, 1.0),
            top_p=get_num(body, "top_p", defaults.get("top_p", 1.0)),
            top_k=get_int(body, "top_k", defaults.get("top_k", 0)), stop=list(stop))
    except RequestError as e:
        raise APIError.from_request_error(e) from None
    meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    salt = get_str(body, "cache_salt", nonempty=True)  # our extension, as on chat completions
    return ParsedRequest(kind="chat", model=get_str(body, "model"), params=params,
                         max_tokens=max_tokens, max_tokens_field="max_tokens",
                         messages=conv.messages, stream=get_bool(body, "stream"),
                         cache_salt=salt, user=meta.get("user_id"), tools=treq,
                         tool_call_prefix="toolu_",
                         structured_field="tool_choice" if treq.forced else
                         "output_config.format", cache_breakpoints=conv.breakpoints,
                         thinking=_thinking(body, max_tokens), response_format=rf)


# ---------------------------------------------------------------------- response
def usage_dict(u: Usage) -> dict:
    read, created = u.cached_tokens, u.cache_creation_tokens
    return {"input_tokens": u.prompt_tokens - read - created, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": created}


def content_blocks(text: str, tools: ToolOutput | None, signature: str) -> list[dict]:
    """The reply's blocks: its reasoning (``signature``: the response id, as deepseek-recipe
    signs it), its text, its calls."""
    if tools is None:
        return [{"type": "text", "text": text}] if text else []
    blocks = [{"type": "thinking", "thinking": tools.reasoning, "signature": signature}] \
        if tools.reasoning is not None else []
    blocks += [{"type": "text", "text": tools.content}] if tools.content else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                     for c in tools.calls]


def error_response(e: APIError) -> JSONResponse:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "overloaded_error"}
    return JSONResponse({"type": "error", "error": {"type": kinds.get(e.status, "api_error"),
                                                    "message": e.message}},
                        status_code=e.status, headers=e.headers)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def message_body(rid: str, model: str, text: str, d: Delta) -> dict:
    """The non-streamed response, from the reply's text and its final delta."""
    stop, seq = stop_reason(d)
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(text, d.tool_output, rid), "stop_reason": stop,
            "stop_sequence": seq, "usage": usage_dict(d.usage)}


def stop_reason(d: Delta) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the reply (if one did)."""
    if d.stop_string is not None:
        return "stop_sequence", d.stop_string
    return STOP_REASONS.get(d.finish_reason, "end_turn"), None


def _delta(index: int, delta: dict) -> str:
    return _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": delta})


class _Blocks:
    """The content block being streamed: a new kind of content closes it and opens the next
    (a thinking block is closed with its signature)."""

    def __init__(self, signature: str) -> None:
        self.signature = signature
        self.index, self.open = 0, None  # open: "thinking" | "text" | "tool_use" | None

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = [_delta(self.index, {"type": "signature_delta", "signature": self.signature})] \
            if self.open == "thinking" else []
        out.append(_event("content_block_stop", {"type": "content_block_stop",
                                                 "index": self.index}))
        self.index += 1
        self.open = None
        return out

    def start(self, block: dict) -> list[str]:
        out = self.close()
        self.open = block["type"]
        return out + [_event("content_block_start", {"type": "content_block_start",
                                                     "index": self.index, "content_block": block})]

    def text(self, kind: str, text: str) -> list[str]:
        """A thinking or text fragment, in its block."""
        block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        out = [] if self.open == kind else self.start(block)
        return out + [_delta(self.index, {"type": f"{kind}_delta", kind: text})]


async def stream_events(rid: str, model: str, num_prompt_tokens: int,
                        deltas: AsyncIterator[Delta], tools: ReplyStream | None
                        ) -> AsyncIterator[str]:
    """The SSE events of a streamed reply: message_start, content blocks (thinking and text
    deltas, tool_use blocks with their input as input_json_delta fragments), message_delta,
    message_stop."""
    start_usage = {"input_tokens": num_prompt_tokens, "output_tokens": 0,
                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    yield _event("message_start", {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    blocks = _Blocks(rid)
    async for d in deltas:
        if d.error:
            yield _event("error", {"type": "error", "error": {"type": "api_error",
                                                              "message": d.error}})
            return
        reasoning, text, calls = "", d.text, []
        if tools is not None:
            piece = tools.finish(d.tool_output, d.token_ids) if d.final else \
                tools.push(d.text, d.token_ids)
            reasoning, text, calls = piece.reasoning, piece.content, piece.calls
        events = blocks.text("thinking", reasoning) if reasoning else []
        events += blocks.text("text", text) if text else []
        for call in calls:
            if call.id is not None:  # a new call: its tool_use block
                events += blocks.start({"type": "tool_use", "id": call.id, "name": call.name,
                                        "input": {}})
            if call.arguments:
                events.append(_delta(blocks.index, {"type": "input_json_delta",
                                                    "partial_json": call.arguments}))
        for e in events:
            yield e
        if d.final:
            for e in blocks.close():
                yield e
            stop, seq = stop_reason(d)
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop, "stop_sequence": seq},
                                           "usage": usage_dict(d.usage)})
            yield _event("message_stop", {"type": "message_stop"})
