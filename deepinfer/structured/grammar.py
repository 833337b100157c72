"""Enforcing a ``StructuredOutput`` with llguidance: compile per spec, match per sequence.

llguidance was chosen over xgrammar and outlines-core (see docs/server.md, "Structured
outputs"): xgrammar masks faster per token on CPU but let raw control characters into
length-bounded JSON strings (invalid JSON, found by tests/structured), and outlines-core
compiles each schema into a token index up front (slow per schema, slow tail per token).
JSON is generated compact unless the schema's ``x-guidance`` asks otherwise, so a schema that
bounds its strings and arrays bounds the output, and a weak model cannot loop on spaces. The
matcher allows the model's stop tokens once the output is complete; a stopped matcher ends
the request (``terminated``).

Only the rows of constrained requests pay: ``apply_masks`` is not called for a batch with
none, and fills one bitmask row per constrained request.
"""

from __future__ import annotations

import functools

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from ..errors import RequestError
from .spec import FIELD, StructuredOutput

_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarCompiler:
    """Compiles specs against one tokenizer (the last compiled grammars are kept)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(stop_token_ids))
        self.compile = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, so: StructuredOutput) -> str:
        """The llguidance grammar of ``so``; RequestError (``structured_output``) if invalid."""
        M = llguidance.LLMatcher
        try:
            if so.kind == "json_object":
                grammar = M.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)
            elif so.kind == "json_schema":
                grammar = M.grammar_from_json_schema(so.spec, defaults=_JSON_DEFAULTS)
            elif so.kind == "regex":
                grammar = M.grammar_from_regex(so.spec)
            else:
                grammar = M.grammar_from_lark(so.spec)
        except ValueError as e:
            raise RequestError(FIELD, f"invalid {so.kind}: {e}") from None
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(FIELD, f"invalid {so.kind}: {error.splitlines()[0][:300]}")
        return grammar

    def matcher(self, grammar: str) -> GrammarState:
        return GrammarState(self.tokenizer, grammar)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (one bit per token)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_stopped()

    def fresh(self) -> GrammarState:
        """A new matcher at the start of the same grammar (for a forked sample)."""
        return GrammarState(self._tokenizer, self._grammar)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, for ``rows``."""
    V = logits.shape[1]
    bitmask = torch.zeros(len(rows), -(-V // 32), dtype=torch.int32)
    for j, state in enumerate(states):
        state.fill(bitmask, j)
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).view(len(rows), -1)[:, :V].bool()
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
