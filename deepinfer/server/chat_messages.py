"""Chat ``messages`` checked and normalized: the one message shape the prompt builders read."""

from __future__ import annotations

from typing import Any

from ..errors import RequestError
from .api_error import APIError, bad
from .request_fields import shown
from .tools.request import tool_message_fields

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


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
                                       f"{shown(role)}")
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
