"""When a request stops, and the text it returns.

One place for the stop rules every path applies after appending a token (plain decode,
verified speculative tokens, forked samples): a grammar that terminated, an EOS or stop
token, a stop string ending in the newest token, max_tokens, or the model's context length.
"""

from __future__ import annotations

from collections.abc import Set

from .request import Request


class StopRules:
    def __init__(self, tokenizer, eos_token_ids: Set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def finish_reason(self, req: Request) -> str | None:
        """``"stop"`` or ``"length"`` if the newest token ends ``req`` (``req.stop_reason``
        set to what matched), else None."""
        p, tok = req.params, req.output_token_ids[-1]
        if req.grammar is not None and req.grammar.terminated:
            req.stop_reason = tok
            return "stop"
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            req.stop_reason = tok
            return "stop"
        if p.stop and (hit := self._stop_string(req)) is not None:
            req.stop_reason = hit
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_string(self, req: Request) -> str | None:
        # A stop string can only end in the newest token (an earlier one would have stopped
        # the request already): decode just enough tail tokens, once, to see the longest.
        n = min(len(req.output_token_ids), max(map(len, req.params.stop)) + 4)
        tail = self.tokenizer.decode(req.output_token_ids[-n:], skip_special_tokens=False)
        return next((s for s in req.params.stop if s in tail), None)

    def output_text(self, req: Request) -> str:
        """Generated text, cut before a matched stop string (which is not returned)."""
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if isinstance(req.stop_reason, str):
            cut = text.find(req.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text
