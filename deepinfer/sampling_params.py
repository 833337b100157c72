"""Per-request sampling parameters (vLLM-shaped) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RequestError
from .limits import (INT64_MAX, MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, SEED_MAX, SEED_MIN,
                     encodable, is_finite_number, is_int)
from .structured.spec import StructuredOutput


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus top-k alternatives
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (multiplies if < 0) logits of prompt+output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    n: int = 1  # samples returned; they share the prompt's KV (one prefill)
    best_of: int | None = None  # samples drawn (>= n); the n of highest cumulative logprob return
    structured_output: StructuredOutput | None = None  # grammar the output must follow
    # Compute the prompt's KV and stop before the first token (finish reason "prefill"): a
    # prefill worker's request (server/pd.py); nothing is sampled.
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the bad field, so the server can answer 400 with it.

        Ranges are those the sampler can use (``deepinfer/limits.py``): a value that passed
        here never fails a step."""
        t = self.temperature
        checks = [
            ("max_tokens", is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX,
             "must be an integer >= 1"),
            ("temperature", is_finite_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
             f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
            ("top_p", is_finite_number(self.top_p) and MIN_TOP_P <= self.top_p <= 1.0,
             f"must be in [{MIN_TOP_P:g}, 1]"),
            ("top_k", is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX,
             "must be -1, 0 or a positive 64-bit integer"),
            ("min_p", is_finite_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("seed", self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             "must be an integer in [-2**63, 2**64 - 1]"),
            ("stop", isinstance(self.stop, list)
             and all(isinstance(s, str) and s and encodable(s) for s in self.stop),
             "must be non-empty strings of valid Unicode text"),
            ("stop_token_ids", isinstance(self.stop_token_ids, list)
             and all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("presence_penalty", is_finite_number(self.presence_penalty)
             and -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", is_finite_number(self.frequency_penalty)
             and -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", is_finite_number(self.repetition_penalty)
             and 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("logit_bias", isinstance(self.logit_bias, dict) and all(
                is_int(t) and 0 <= t <= INT64_MAX and is_finite_number(b) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()),
             "must map non-negative token ids to biases in [-100, 100]"),
            ("n", is_int(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("best_of", self.best_of is None or (is_int(self.best_of)
                                                 and self.best_of >= self.n),
             "must be an integer >= n"),
            ("prefill_only", isinstance(self.prefill_only, bool), "must be a boolean"),
            ("structured_output", self.structured_output is None
             or isinstance(self.structured_output, StructuredOutput),
             "must be a StructuredOutput"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise RequestError(name, f"{msg}, got {_shown(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences this request decodes (``best_of``, else ``n``)."""
        return self.best_of or self.n

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _shown(v: object) -> str:
    """A bad value for an error message: bounded, and printable whatever it holds."""
    if isinstance(v, int) and v.bit_length() > 128:  # str() of a huge int is slow, or refused
        return f"an integer of {v.bit_length()} bits"
    r = ascii(v)
    return r if len(r) <= 80 else r[:77] + "..."
