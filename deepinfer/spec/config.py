"""SpeculativeConfig: which draft source, how many tokens, fixed-k or scheduled."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # ngram: prompt lookup in the request itself; suffix: index shared by requests
    num_tokens: int = 3  # k: the most draft tokens proposed (and, fixed-k, verified) per request per step
    scheduled: bool = False  # True: Algorithm 1 picks how many of each draft to verify from confidences
    ngram_min: int = 1  # shortest suffix match that yields a draft
    ngram_max: int = 4  # longest suffix matched
    # SPS(B) profile for the scheduler: verify steps per second at these batch token counts;
    # None: measured on the engine's device and model at start-up
    sps_tokens: tuple[int, ...] | None = None
    sps_steps_per_s: tuple[float, ...] | None = None
    calibration_window: int = 2000  # verification outcomes in the rolling ECE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError("speculative num_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if (self.sps_tokens is None) != (self.sps_steps_per_s is None):
            raise ValueError("sps_tokens and sps_steps_per_s go together")
        if self.sps_tokens is not None and len(self.sps_tokens) != len(self.sps_steps_per_s or ()):
            raise ValueError("sps_tokens and sps_steps_per_s must have the same length")
        if self.calibration_window < 1:
            raise ValueError("calibration_window must be >= 1")
