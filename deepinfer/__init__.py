"""DeepInfer: an LLM inference engine that serves repeated prefixes from a tiered KV cache."""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
