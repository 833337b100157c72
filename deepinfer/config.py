"""Engine configuration: every knob in one dataclass, validated once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .spec.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str | None = None  # local HF folder or .gguf file; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16 matmul, else float32
    device: str = "auto"  # auto: cuda if available else cpu
    threads: int | None = None  # intra-op compute threads; None: the cores this process may use
    fixed_threads: bool = False  # keep `threads` even where other processes take cores (threads.CoreShare)
    quantization: str = "none"  # weight-only: none | int8 | int4 (every linear layer, LM head too)
    quantization_kernel: str = "auto"  # auto (fastest here) | native | native-int8 | native-float | fbgemm | tinygemm | dequant
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
    # Sliding-window layers (kv/window/): per-sequence rings and prefix reuse on hybrid models.
    window_ring: bool = True  # sliding layers keep only their window (False: every token, paged)
    window_reuse: str = "snapshot"  # snapshot (replay as fallback) | replay | off (recompute hits)
    window_snapshot_interval: int | None = None  # tokens between snapshots; None: the window; 0: none
    window_snapshot_gb: float = 1.0  # host memory for window snapshots (LRU)
    window_replay_tokens: int | None = None  # None: exact replay; fewer tokens: lossy, bounded
    window_chunk_tokens: int | None = None  # largest prefill chunk per sequence; None: the window
    # Lower KV tiers (kv/tiers/). Both on by default with bounded sizes, so
    # a restarted engine keeps its cache with no flags.
    host_cache_gb: float = 4.0  # L2 host DRAM (pinned on CUDA), at most half the available RAM; 0 = off
    enable_disk_cache: bool = True  # L3
    disk_cache_dir: str | None = None  # None: $DEEPINFER_KV_CACHE_DIR, else $DEEPINFER_CACHE_DIR/kv, else ~/.cache/deepinfer/kv
    disk_cache_gb: float = 20.0  # L3 bound (also at most the files there + half the free space)
    kv_codec_host: str = "lossless"  # lossless | fp8 | fp4 | mxfp4
    kv_codec_disk: str = "lossless"
    # Key of the L3 files' MAC (keyed BLAKE2b over header + payload): a shared directory cannot
    # be poisoned by anyone without it. None: an XXH3-128 (catches damage, not forgery).
    kv_store_secret: str | None = field(default=None, repr=False)
    cache_policy: str = "write_through"  # write_through | write_back | selective
    # Networked L3 shared by engines (kv/tiers/store_clients.py), behind the local directory.
    kv_store: str | None = None  # mooncake://MASTER_HOST:PORT | redis://HOST:PORT[/DB]
    kv_store_options: dict[str, str] = field(default_factory=dict)  # the store's own options
    selective_hits: int = 2  # selective: lookups a prefix needs before it is written to L3
    # While idle (server), promote the L3-only pages of recent conversations to L2, at most this
    # many MiB per idle period (kv/tiers/promotion.py); 0 = off (the default)
    kv_idle_promote_mb: float = 0.0
    # L3 hits load layer by layer and their prefill starts at once, layer i waiting for its KV
    # (kv/tiers/layer_stream.py); not with overlap_schedule (a streaming request is not drafted
    # for while its step runs on the stream)
    kv_stream_layers: bool = False
    # spec/: on by default, method auto, scheduled (Algorithm 1 verifies only drafts that pay;
    # README "Speculative decoding"); None or method none: off. auto steps aside for
    # overlap_schedule, which cannot run with it, and for quantized weights, where it did not
    # pay (an explicit method still speculates there)
    speculative_config: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    # overlap.py: the engine schedules step N+1 and lands N-1 while N's forward runs on a worker
    # thread; outputs are identical either way
    overlap_schedule: bool = False
    # decode attention: auto (our CPU kernel reading pages in place, where it applies) | torch
    attention_backend: str = "auto"
    # every step through the Python modules: no native decode stack (models/llama_native.py)
    enforce_eager: bool = False
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.page_size:
            raise ValueError("max_num_batched_tokens must be >= page_size")
        from .kv.tiers.codecs import CODEC_NAMES
        from .kv.tiers.policy import POLICIES

        for name in ("kv_codec_host", "kv_codec_disk"):
            if getattr(self, name) not in CODEC_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(CODEC_NAMES)}, got {getattr(self, name)!r}")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"cache_policy must be one of {', '.join(POLICIES)}, got {self.cache_policy!r}")
        if self.host_cache_gb < 0 or self.disk_cache_gb < 0 or self.kv_idle_promote_mb < 0:
            raise ValueError("host_cache_gb, disk_cache_gb and kv_idle_promote_mb must be >= 0")
        if self.kv_store is not None:
            from .kv.tiers.store_clients import check_store_url

            check_store_url(self.kv_store, self.kv_store_options)
        if self.selective_hits < 1:
            raise ValueError("selective_hits must be >= 1")
        from .kv.window.manager import REUSE_MODES

        if self.window_reuse not in REUSE_MODES:
            raise ValueError(f"window_reuse must be one of {', '.join(REUSE_MODES)}, got {self.window_reuse!r}")
        for name in ("window_snapshot_interval", "window_replay_tokens", "window_chunk_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.window_snapshot_gb < 0:
            raise ValueError("window_snapshot_gb must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        from .quant.kernels import KERNELS, QUANTIZATIONS

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_kernel not in KERNELS:
            raise ValueError(f"quantization_kernel must be one of {', '.join(KERNELS)}, "
                             f"got {self.quantization_kernel!r}")
        from .layers.native_decode import ATTENTION_BACKENDS

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        sc = self.speculative_config
        if sc is not None and (sc.method == "none" or (sc.method == "auto" and (
                self.overlap_schedule or self.quantization != "none"))):
            self.speculative_config = None  # one way to say off downstream

    def disk_cache_path(self) -> str | None:
        """The L3 directory, or None when L3 is off."""
        if not self.enable_disk_cache or self.disk_cache_gb <= 0:
            return None
        if self.disk_cache_dir:
            return str(self.disk_cache_dir)
        return str(default_disk_dir())

    def torch_device(self) -> torch.device:
        """auto: $DEEPINFER_DEVICE when set (the test suite pins its device this way), else
        cuda if available, else cpu."""
        if self.device == "auto":
            if os.environ.get("DEEPINFER_DEVICE"):
                return torch.device(os.environ["DEEPINFER_DEVICE"])
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """auto: $DEEPINFER_DTYPE when set, else per device."""
        if self.dtype == "auto" and os.environ.get("DEEPINFER_DTYPE"):
            return _DTYPES[os.environ["DEEPINFER_DTYPE"]]
        if self.dtype == "auto":
            from .hardware import auto_dtype

            return auto_dtype(self.torch_device())
        return _DTYPES[self.dtype]


def default_disk_dir() -> Path:
    """``$DEEPINFER_KV_CACHE_DIR``, else ``$DEEPINFER_CACHE_DIR/kv``, else ``~/.cache/deepinfer/kv``."""
    if os.environ.get("DEEPINFER_KV_CACHE_DIR"):
        return Path(os.environ["DEEPINFER_KV_CACHE_DIR"]).expanduser()
    base = os.environ.get("DEEPINFER_CACHE_DIR")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "deepinfer") / "kv"
