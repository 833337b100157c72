"""Per-request sampling parameters (vLLM-shaped) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RequestError
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the bad field, so the server can answer 400 with it."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             "must be an integer >= 1"),
            ("temperature", _num(self.temperature) and 0.0 <= self.temperature <= 100.0,
             "must be in [0, 100]"),
            ("top_p", _num(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be -1, 0 or positive"),
            ("min_p", _num(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                   and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("presence_penalty", _num(self.presence_penalty)
             and -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", _num(self.frequency_penalty)
             and -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", _num(self.repetition_penalty)
             and 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("logit_bias", isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and _num(b) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()),
             "must map non-negative token ids to biases in [-100, 100]"),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("best_of", self.best_of is None or (isinstance(self.best_of, int)
                                                 and self.best_of >= self.n),
             "must be an integer >= n"),
            ("structured_output", self.structured_output is None
             or isinstance(self.structured_output, StructuredOutput),
             "must be a StructuredOutput"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise RequestError(name, f"{msg}, got {getattr(self, name)!r}")

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


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
