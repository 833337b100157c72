"""Value ranges the engine can use, shared by the offline API and the HTTP server.

Anything outside these ranges would fail later, inside a step (a tensor that cannot hold the
integer, a temperature that divides the logits into infinities, a string the hashes cannot
encode) and take the other requests of that step down with it. So both entry points check
them first and answer with a ``RequestError`` naming the field.
"""

from __future__ import annotations

import math

from .errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch.Generator.manual_seed takes [-2**63, 2**64); a negative seed is used modulo 2**64
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Below this the logits divided by the temperature overflow fp32 (temperature 0 is greedy).
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
# top_p is compared in fp32: a smaller positive value rounds to 0 and would keep no token.
MIN_TOP_P = 1e-6


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def encodable(s: str) -> bool:
    """True if ``s`` is valid Unicode text (no lone surrogates), i.e. it encodes as UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(field: str, s: object, nonempty: bool = False) -> str:
    """``s`` as a string the tokenizer and the page hashes can encode, else RequestError."""
    if not isinstance(s, str):
        raise RequestError(field, f"must be a string, got {type(s).__name__}")
    if nonempty and not s:
        raise RequestError(field, "must not be empty")
    if not encodable(s):
        raise RequestError(field, "must be valid Unicode text (it contains a lone surrogate)")
    return s
