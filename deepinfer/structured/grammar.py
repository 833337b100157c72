"""Enforcing a ``StructuredOutput`` with xgrammar: compile per spec, match per sequence.

xgrammar was chosen over llguidance and outlines-core by per-token mask cost on CPU (see
docs/server.md, "Structured outputs"). JSON is generated compact (no free whitespace), so a
schema that bounds its strings and arrays bounds the output, and a weak model cannot loop on
spaces. The matcher allows the model's stop tokens once the output is complete; a finished
matcher ends the request (``terminated``).

Only the rows of constrained requests pay: ``apply_masks`` is not called for a batch with
none, and fills one bitmask row per constrained request.
"""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from ..errors import RequestError
from .spec import FIELD, StructuredOutput

_SEPARATORS = (",", ":")


class GrammarCompiler:
    """Compiles specs against one tokenizer (xgrammar caches compiled grammars per spec)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """Raises RequestError (field ``structured_output``) for a spec xgrammar rejects."""
        c = self._compiler
        try:
            if so.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=_SEPARATORS, strict_mode=False)
            if so.kind == "json_schema":
                return c.compile_json_schema(so.spec, any_whitespace=False,
                                             separators=_SEPARATORS, strict_mode=True)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "ebnf":
                return c.compile_grammar(so.spec)
            return c.compile_structural_tag(json.loads(so.spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            raise RequestError(FIELD, f"invalid {so.kind}: {_first_line(e)}") from None

    def matcher(self, grammar: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(grammar), grammar)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, grammar: xgr.CompiledGrammar) -> None:
        self._matcher = matcher
        self.grammar = grammar

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (one bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fresh(self) -> GrammarState:
        """A new matcher at the start of the same grammar (for a forked sample)."""
        return GrammarState(xgr.GrammarMatcher(self.grammar), self.grammar)


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, for ``rows``."""
    vocab_size = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=vocab_size, indices=rows)


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
