"""KV-cache bytes per token, computed from the engine's own layouts.

The model class is instantiated on the meta device (no memory, no weights) and asked for its
``KVSpec`` list, exactly as the runner does; each owned component is then sized with the KV codec's
``encoded_nbytes`` for one page of ``page_size`` tokens (the unit the tiers store).

Run ``python -m deepinfer.models.kv_size`` to print the table in ``docs/kv_sizes.md``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from ..kv.tiers.codecs import get_codec
from ..kv.layout import KVSpec
from .registry import model_class


def model_kv_specs(config) -> list[KVSpec]:
    """The per-layer KV layout our model class declares for ``config`` (built on meta)."""
    with torch.device("meta"):
        model = model_class(config)(config, 1)
    return model.kv_specs()


def share_adjacent(specs: list[KVSpec], group: int) -> list[KVSpec]:
    """Layout-level cross-layer sharing: within each run of ``group`` adjacent layers, layers whose
    spec (components, window) equals the run's first layer read its cache instead of owning one."""
    out = list(specs)
    for i, s in enumerate(specs):
        head = i - i % group
        if i != head and s.share_with is None and specs[head].share_with is None \
                and s.components == specs[head].components and s.window == specs[head].window:
            out[i] = replace(s, share_with=head)
    return out


def supports_sharing(config) -> bool:
    """Whether the model class implements cross-layer sharing itself (the Llama family)."""
    from .llama import LlamaForCausalLM

    return model_class(config) is LlamaForCausalLM


@dataclass
class KVSize:
    layers: int
    owning_layers: int
    full_layers: int  # owned full-attention layers
    sliding_layers: int  # owned sliding-window layers
    window: int | None
    per_token_full: float  # bytes/token of the owned full-attention layers
    per_token_sliding: float  # bytes/token of the owned sliding layers (if they kept every token)
    shared_by: str  # "model", "layout" or "" (how sharing was applied)

    @property
    def per_token_all(self) -> float:
        """Bytes/token as the pool stores today: one page id spans every layer, so sliding layers
        keep all tokens too."""
        return self.per_token_full + self.per_token_sliding

    @property
    def window_bytes_per_seq(self) -> float:
        """Fixed per-sequence cost if sliding layers kept only their last W tokens."""
        return self.per_token_sliding * (self.window or 0)


def component_bytes_per_token(spec: KVSpec, codec_name: str, dtype: torch.dtype,
                              page_size: int) -> float:
    codec = get_codec(codec_name, page_size=page_size)
    rows = spec.rows_per_page(page_size)  # page_size, or fewer for compressed KV entries
    return sum(codec.encoded_nbytes((rows, *shape), dtype) for _, shape in spec.components) / page_size


def kv_layout(config, share: int = 1) -> tuple[list[KVSpec], str]:
    """Layer specs of ``config``'s model, with adjacent layers grouped by ``share`` when > 1:
    through the model's own switch (``cross_layer_kv_share``) when its class implements it
    ("model"), else at layout level ("layout", see ``share_adjacent``)."""
    if share > 1 and supports_sharing(config):
        config = copy.deepcopy(config)
        config.cross_layer_kv_share = share
        return model_kv_specs(config), "model"
    specs = model_kv_specs(config)
    if share > 1:
        return share_adjacent(specs, share), "layout"
    return specs, ""


def size_of(specs: list[KVSpec], codec: str = "lossless", dtype: torch.dtype = torch.bfloat16,
            page_size: int = 16, shared_by: str = "") -> KVSize:
    owned = [s for s in specs if s.owns_cache]
    full = [s for s in owned if s.window is None]
    sliding = [s for s in owned if s.window is not None]
    windows = {s.window for s in sliding}
    if len(windows) > 1:
        raise ValueError(f"several sliding windows: {sorted(windows)}")
    size = lambda group: sum(component_bytes_per_token(s, codec, dtype, page_size) for s in group)  # noqa: E731
    return KVSize(layers=len(specs), owning_layers=len(owned), full_layers=len(full),
                  sliding_layers=len(sliding), window=windows.pop() if windows else None,
                  per_token_full=size(full), per_token_sliding=size(sliding), shared_by=shared_by)


def kv_bytes_per_token(config, codec: str = "lossless", dtype: torch.dtype = torch.bfloat16,
                       page_size: int = 16, share: int = 1) -> KVSize:
    """KV bytes per token of ``config``'s model under ``codec`` (``lossless`` = raw ``dtype``),
    split into full-attention and sliding-window layers; ``share`` groups adjacent layers."""
    specs, shared_by = kv_layout(config, share)
    return size_of(specs, codec, dtype, page_size, shared_by)


# --------------------------------------------------------------------------- reference configs

def reference_configs() -> dict[str, object]:
    """Published architectures, built with transformers config classes (numbers typed in)."""
    from transformers import (DeepseekV2Config, DeepseekV3Config, Gemma3TextConfig, GptOssConfig,
                              LlamaConfig)

    def arch(cfg, name):
        cfg.architectures = [name]
        return cfg

    return {
        "Llama-3-8B (GQA)": arch(LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "LlamaForCausalLM"),
        "SmolLM2-135M (GQA)": arch(LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
            "LlamaForCausalLM"),
        "DeepSeek-V3 (MLA)": arch(DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
            n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
            v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
            first_k_dense_replace=3, max_position_embeddings=163840,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
            "DeepseekV3ForCausalLM"),
        "DeepSeek-V2-Lite (MLA)": arch(DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
            qk_nope_head_dim=128, num_experts_per_tok=6, first_k_dense_replace=1,
            max_position_embeddings=163840,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
            "DeepseekV2ForCausalLM"),
        "Gemma-3-270M (5 local : 1 global)": arch(Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            query_pre_attn_scalar=256, max_position_embeddings=32768, sliding_window_pattern=6,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
            "Gemma3ForCausalLM"),
        "Gemma-3-27B (5 local : 1 global)": arch(Gemma3TextConfig(
            vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
            query_pre_attn_scalar=168, max_position_embeddings=131072, sliding_window_pattern=6,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1000000.0}}),
            "Gemma3ForCausalLM"),
        "gpt-oss-20b (1 local : 1 global)": arch(GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
            num_local_experts=32, num_experts_per_tok=4, max_position_embeddings=131072),
            "GptOssForCausalLM"),
    }


def v4_reference_configs() -> dict[str, object]:
    """DeepSeek-V4 architectures as their published config.json files give them (numbers typed
    in; ``compress_ratios`` per layer: 0 window only, 4 CSA, 128 HCA, last entry the MTP layer),
    and V4.1-Flash as NeMo Automodel's ``DeepseekV41TextConfig`` defaults give it ("defaults
    match the released Flash text configuration", HF revision df42c109): CSA2 with ratio 2 in
    layers 2-19 and 1 in layers 20-39, long KV computed by layers 2, 8, 14, 20 only."""
    from transformers import DeepseekV4Config

    from .deepseek_v41_config import DeepseekV41Config

    common = dict(vocab_size=129280, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
                  sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, num_hash_layers=3,
                  n_shared_experts=1, num_experts_per_tok=6, index_n_heads=64, index_head_dim=128,
                  max_position_embeddings=1048576, compress_rope_theta=160000,
                  rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                "original_max_position_embeddings": 65536})
    flash = DeepseekV4Config(**common, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_topk=512,
                             n_routed_experts=256, moe_intermediate_size=2048,
                             compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
    pro = DeepseekV4Config(**common, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                           q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024,
                           n_routed_experts=384, moe_intermediate_size=3072,
                           compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    v41 = DeepseekV41Config(**{**common, "num_hash_layers": 0, "index_n_heads": 32},
                            hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
                            q_lora_rank=1280, o_groups=8, o_lora_rank=1024, index_topk=512,
                            n_routed_experts=384, moe_intermediate_size=2304,
                            compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
                            kv_source_layer_ids=[2, 8, 14, 20],
                            index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                            candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8)
    for cfg in (flash, pro):
        cfg.architectures = ["DeepseekV4ForCausalLM"]
    v41.architectures = ["DeepseekV41ForCausalLM"]
    return {"DeepSeek-V4-Flash": flash, "DeepSeek-V4-Pro": pro, "DeepSeek-V4.1-Flash": v41}


def v4_sizes(config, codec: str = "lossless", page_size: int = 16) -> dict:
    """A V4 / V4.1 model's KV as the engine lays it out: paged bytes/token (compressed entries and
    indexer keys of the layers owning them, per attention type and per ratio) and ring bytes per
    sequence (window K=V plus compressor inputs, for ring_window tokens)."""
    from .deepseek_v4_attention import compress_ratio, ring_window

    specs = model_kv_specs(config)
    n = config.num_hidden_layers
    rings, entries = specs[:n], specs[n:]
    kinds = [config.layer_types[i] for i in range(n) if compress_ratio(config, i) is not None]
    owned = [(s, k) for s, k in zip(entries, kinds) if s.owns_cache]
    per = lambda s: component_bytes_per_token(s, codec, torch.bfloat16, page_size)  # noqa: E731
    out: dict = {"layers": dict((t, config.layer_types.count(t)) for t in sorted(set(config.layer_types))),
                 "window_only": n - len(kinds), "compressed": len(kinds), "owning": len(owned)}
    for kind in sorted(set(kinds)):
        out[kind] = sum(per(s) for s, k in owned if k == kind)
    out["by_ratio"] = {r: sum(per(s) for s, _ in owned if s.tokens_per_entry == r)
                       for r in sorted({s.tokens_per_entry for s, _ in owned})}
    out["paged_per_token"] = sum(per(s) for s, _ in owned)
    out["ring_per_seq"] = sum(per(s) for s in rings) * ring_window(config)
    return out


CODECS = (("bf16", "lossless"), ("fp8", "fp8"), ("fp4", "fp4"))


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 or x == int(x) else f"{x:,.1f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def tables(page_size: int = 16) -> str:
    """Markdown: bytes per token per codec (plain and with sharing of 2), then the hybrids'
    sliding-window cost."""
    names = [c for c, _ in CODECS]
    per_token = [_row(["model", "layers (full + sliding)"] + [f"{c} B/token" for c in names]
                      + [f"{c} B/token, share 2" for c in names]),
                 "|---|---|" + "---:|" * (2 * len(names))]
    window = [_row(["model", "window W", "sliding layers (share 2)"]
                   + [f"{c} window B/seq" for c in names]
                   + [f"{c} window B/seq, share 2" for c in names]
                   + [f"{c} B/token, all layers (pool today)" for c in names]),
              "|---|---:|---|" + "---:|" * (3 * len(names))]
    for name, cfg in reference_configs().items():
        specs, _ = kv_layout(cfg)
        specs2, how = kv_layout(cfg, 2)
        plain = [size_of(specs, codec, page_size=page_size) for _, codec in CODECS]
        shared = [size_of(specs2, codec, page_size=page_size, shared_by=how) for _, codec in CODECS]
        mark = "" if how == "model" else " *"
        p0 = plain[0]
        per_token.append(_row([name, f"{p0.layers} ({p0.full_layers} + {p0.sliding_layers})"]
                              + [_fmt(k.per_token_full) for k in plain]
                              + [_fmt(k.per_token_full) + mark for k in shared]))
        if p0.sliding_layers:
            window.append(_row([name, str(p0.window), f"{p0.sliding_layers} ({shared[0].sliding_layers})"]
                               + [_fmt(k.window_bytes_per_seq) for k in plain]
                               + [_fmt(k.window_bytes_per_seq) + mark for k in shared]
                               + [_fmt(k.per_token_all) for k in plain]))
    return "\n".join(per_token) + "\n\n" + "\n".join(window) + "\n\n" + v4_table(page_size)


def v4_table(page_size: int = 16) -> str:
    rows = [_row(["model", "page", "layers (window / compressed / owning entries)", "codec",
                  "entries B/token, per ratio r", "paged B/token", "ring B/seq"]),
            "|---|---:|---|---|---|---:|---:|"]
    for name, cfg in v4_reference_configs().items():
        for ps in (page_size, 128):
            for label, codec in CODECS[:2]:
                k = v4_sizes(cfg, codec, ps)
                ratios = ", ".join(f"r{r}: {_fmt(b)}" for r, b in k["by_ratio"].items())
                rows.append(_row([name, str(ps), f"{k['window_only']} / {k['compressed']} / {k['owning']}",
                                  label, ratios, _fmt(k["paged_per_token"]), _fmt(k["ring_per_seq"])]))
    return "\n".join(rows)


if __name__ == "__main__":
    print(tables())
