"""Engine configuration: every knob in one dataclass, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str | None = None  # local HF folder or .gguf file; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU (no bf16 units), bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    # 16 tokens per page: a hit is lost at most 15 tokens short of the true prefix, while a page
    # of SmolLM2 KV (30 layers) is still 1.5 MB at fp32, large enough for efficient tier I/O.
    page_size: int = 16
    num_pages: int | None = None  # device KV pool size; default from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    enable_prefix_cache: bool = True
    max_node_pages: int = 64  # fixed-interval cap on a radix node (cache-unit granularity)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.page_size:
            raise ValueError("max_num_batched_tokens must be >= page_size")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
