"""A chat request's thinking mode, in the spellings clients send it.

DeepSeek's API: ``thinking: {"type": "enabled" | "disabled"}`` and ``reasoning_effort``;
vLLM-style ``chat_template_kwargs: {"thinking": bool}`` (or Qwen's ``enable_thinking``).
Only encodings that render thinking read it (DeepSeek-V4 through ``deepseek_encoding.py``);
HF chat templates do not get it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RequestError

_KWARGS = ("thinking", "enable_thinking")  # chat_template_kwargs keys that switch thinking


@dataclass(frozen=True)
class Thinking:
    enabled: bool | None = None  # None: the model's default
    effort: str | None = None  # None: the model's default; the encoding checks the value


def parse_thinking(body: dict) -> Thinking:
    enabled = None
    t = body.get("thinking")
    if t is not None:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("enabled", "disabled"):
            raise RequestError("thinking", 'must be {"type": "enabled"} or {"type": "disabled"}')
        enabled = kind == "enabled"
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise RequestError("chat_template_kwargs", "must be an object")
        for key in _KWARGS:
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise RequestError(f"chat_template_kwargs.{key}", "must be a boolean")
                enabled = kw[key] if enabled is None else enabled
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError("reasoning_effort", "must be a string")
    return Thinking(enabled, effort)
