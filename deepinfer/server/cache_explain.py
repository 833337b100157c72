"""The body of ``POST /v1/cache/explain`` and the records it draws on.

Per tenant: the walk follows the page chain of the request's own ``cache_salt``, and the
"recently cached" record holds chained page hashes, which only that salt's chain can match.
The one hint about other tenants, "the same tokens are cached under another salt", needs
the salts seen lately; they are recorded only when the operator turns cross-tenant hints on
(``--explain-cross-tenant``). Everything here runs on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..engine import LLMEngine
from ..kv.explain import explain_prefix
from ..request import Request
from .prompts import BuiltPrompt

MAX_SALTS = 256  # salts remembered for the cross-tenant "cached under another salt" probe
CONTEXT_TOKENS = 16  # decoded context each side of where cache matching stops


class CacheExplainer:
    def __init__(self, engine: LLMEngine, recent_pages: int, cross_tenant: bool) -> None:
        self.engine = engine
        self.recent_pages = recent_pages
        self.cross_tenant = cross_tenant
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._salts: OrderedDict[str | None, None] = OrderedDict({None: None})

    def note_salt(self, salt: str | None) -> None:
        if not self.cross_tenant:
            return
        self._salts[salt] = None
        self._salts.move_to_end(salt)
        while len(self._salts) > MAX_SALTS:
            self._salts.popitem(last=False)

    def remember_pages(self, req: Request, computed_tokens: int) -> None:
        """Note the page hashes ``req`` cached, to tell 'evicted' from 'never cached'."""
        kv = self.engine.kv
        if kv.tree is None or self.recent_pages <= 0:
            return
        n = min(len(req.page_hashes), max(0, computed_tokens) // kv.page_size)
        rp = self._recent
        for h in req.page_hashes[:n]:
            rp[h] = None
            rp.move_to_end(h)
        while len(rp) > self.recent_pages:
            rp.popitem(last=False)

    def explain(self, built: BuiltPrompt, salt: str | None) -> dict:
        ids = built.token_ids
        self.engine.validate_prompt(ids)
        others = list(self._salts) if self.cross_tenant else []
        ex = explain_prefix(self.engine.kv, ids, salt, other_salts=others,
                            recently_cached=self._recent, context=CONTEXT_TOKENS)
        tok = self.engine.tokenizer
        dec = lambda a: tok.decode(a, skip_special_tokens=False)  # noqa: E731
        c = CONTEXT_TOKENS
        stop: dict[str, Any] = {"reason": ex.reason, "detail": ex.detail,
                                "position": ex.hit_tokens}
        if ex.reason == "diverged":
            d = ex.diverge_at
            off = d - ex.matched_tokens
            cached = ex.cached_tokens or []
            stop["diverge_at"] = d
            stop["request_token"] = {"id": ids[d], "text": dec([ids[d]])} if d < len(ids) else None
            stop["cached_token"] = ({"id": cached[off], "text": dec([cached[off]])}
                                    if off < len(cached) else None)
            stop["context"] = {"before": dec(ids[max(0, d - c):d]),
                               "request_after": dec(ids[d:d + c]),
                               "cached_after": dec(cached[off:off + c])}
        elif ex.reason in ("evicted", "salt", "not_cached"):
            d = ex.matched_tokens
            stop["context"] = {"before": dec(ids[max(0, d - c):d]),
                               "request_after": dec(ids[d:d + c])}
            if ex.reason == "salt":
                stop["other_salt_tokens"] = ex.other_salt_tokens
        return {
            "object": "cache.explanation",
            "prompt_tokens": len(ids),
            "page_size": ex.page_size,
            "cache_salt": salt,
            "prompt_cache_hit_tokens": ex.hit_tokens,
            "prompt_cache_miss_tokens": len(ids) - ex.hit_tokens,
            "cached_tokens_by_tier": ex.hit_tokens_by_tier,
            "matched_tokens": ex.matched_tokens,
            "spans": [{"start": s.start, "end": s.end, "tokens": s.end - s.start, "tier": s.tier}
                      for s in ex.spans],
            "stop": stop,
            "prompt_encoding": {"encoding": built.encoding,
                                "history_rewritten": built.history_rewritten,
                                "reused_tokens": built.reused_tokens},
            "evicted_pages_total": self.engine.stats().get("evicted_pages"),
        }
