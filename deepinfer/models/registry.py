"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from .base import CausalLM
from .llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(config) -> type[CausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(f"unsupported architecture {archs or config.model_type!r}; "
                     f"supported: {sorted(MODEL_CLASSES)}")
