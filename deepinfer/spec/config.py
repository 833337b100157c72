"""SpeculativeConfig: which draft source, how many tokens, fixed-k or scheduled."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("auto", "ngram", "suffix", "draft_model", "none")


@dataclass
class SpeculativeConfig:
    # ngram: prompt lookup in the request itself; suffix: index shared by requests; auto: both,
    # the better calibrated draft per request and step; draft_model: a small model sharing the
    # target's tokenizer (``model``); none: no speculative decoding
    method: str = "auto"
    num_tokens: int = 8  # k: the most draft tokens proposed (and, fixed-k, verified) per request per step
    scheduled: bool = True  # Algorithm 1 picks how many of each draft to verify; False: fixed k
    ngram_min: int = 1  # shortest suffix match that yields a draft
    ngram_max: int = 4  # longest suffix matched
    # SPS(B) profile for the scheduler: verify steps per second at these batch token counts;
    # None: measured on the engine's device and model at start-up
    sps_tokens: tuple[int, ...] | None = None
    sps_steps_per_s: tuple[float, ...] | None = None
    calibration_window: int = 2000  # verification outcomes in the rolling ECE
    model: str | None = None  # draft_model: the draft checkpoint (HF folder or .gguf)
    draft_num_pages: int | None = None  # draft_model: its KV pool; None: as many as the target's
    draft_quantization: str | None = None  # draft_model: none | int8 | int4; None: the target's

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
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative method draft_model needs a draft model path, and a draft "
                             "model path needs method draft_model")
        from ..quant.kernels import QUANTIZATIONS

        if self.draft_quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.draft_quantization!r}")
        if self.draft_num_pages is not None and self.draft_num_pages < 2:
            raise ValueError("draft_num_pages must be >= 2")
        if self.calibration_window < 1:
            raise ValueError("calibration_window must be >= 1")
