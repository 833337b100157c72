"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from .base import CausalLM
from .deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from .deepseek_v4 import DeepseekV4ForCausalLM
from .gemma import GemmaForCausalLM
from .gpt_oss import GptOssForCausalLM
from .llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "DeepseekV41ForCausalLM": DeepseekV4ForCausalLM,  # CSA2 layers, from its DeepseekV41Config
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def model_class(config) -> type[CausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(f"unsupported architecture {archs or config.model_type!r}; "
                     f"supported: {sorted(MODEL_CLASSES)}")
