"""Readers of one request field each: the type and range checks, hand-written (not a schema
library) so that every error names the field and shows the bad value, bounded in length. The
value ranges are those of ``deepinfer/limits.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import RequestError
from ..limits import INT64_MAX, INT64_MIN, is_int
from ..structured.spec import StructuredOutput
from .api_error import bad


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
        raise bad(name, f"must be an integer, got {shown(v)}")
    return _in_range(name, v, lo, hi)


def get_num(body: dict, name: str, default: float | None = None, lo: float | None = None,
            hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(name, f"must be a number, got {shown(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond the float range
        raise bad(name, f"must be a finite number, got {shown(v)}") from None
    if not math.isfinite(f):
        raise bad(name, f"must be a finite number, got {shown(v)}")
    return float(_in_range(name, f, lo, hi))


def _in_range(name: str, v, lo, hi):
    if lo is not None and v < lo:
        raise bad(name, f"must be >= {lo}, got {shown(v)}")
    if hi is not None and v > hi:
        raise bad(name, f"must be <= {hi}, got {shown(v)}")
    return v


def shown(v: Any) -> str:
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
        raise bad(name, f"must be a boolean, got {shown(v)}")
    return v


def get_str(body: dict, name: str, default: str | None = None,
            nonempty: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(name, f"must be a string, got {shown(v)}")
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
            raise bad("logit_bias", f"biases must be numbers in [-100, 100], got {shown(b)}")
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
