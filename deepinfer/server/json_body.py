"""The whole request body, checked before any field is read.

JSON nested at most ``MAX_JSON_DEPTH`` deep, integers of at most 4,300 digits (Python's own
bound), and every string (keys too) valid Unicode, i.e. without lone surrogates, which JSON's
``\\ud800`` escapes can carry and UTF-8 cannot encode. Each error names the first bad path.
"""

from __future__ import annotations

import json

from ..limits import encodable
from .api_error import bad

MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body


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
