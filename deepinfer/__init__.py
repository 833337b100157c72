"""DeepInfer: an LLM inference engine that serves repeated prefixes from a tiered KV cache."""

from .threads import set_process_defaults

set_process_defaults()  # before anything below imports torch (see threads.py)

from .llm import LLM  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
