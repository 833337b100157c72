"""Per-request sampling parameters (vLLM-shaped) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RequestError


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
        ]
        for name, ok, msg in checks:
            if not ok:
                raise RequestError(name, f"{msg}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
