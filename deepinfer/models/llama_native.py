"""The Llama family's decode steps as one native call (``layers/csrc/decode_stack.cpp``).

At batch-1 decode SmolLM2's 30 layers each run a dozen ops of a few microseconds, and the
Python around them (module calls, checks, views, one dispatch per op) cost about a third of the
step (docs/figures/execution.md). ``NativeDecodeStack`` is built once at load from the loaded
layers: their norm weights, rotary tables and each linear's own kernel (``NativeLinear``). A step
of decodes and short spans (speculative verify spans, prefill tails of up to ``SPAN_AS_DECODES``
tokens, whose rows attend as decodes) walks them in C++, calling the very ops the modules call,
so the hidden states are the same bits (tested). It is the CPU counterpart of capturing the
decode step as a CUDA graph, and ``--enforce-eager`` turns it off likewise.

It applies to Llama-family models (Llama, Qwen2, Qwen3, Mistral) whose every layer owns its KV
cache and runs natively here: small ops and paged decode attention built, float32 or bf16 on the
CPU, every linear a kernel with a ``native()`` form (quantized, or bf16 batch rows). Steps with a
longer prefill chunk, ring views, layer-wise loads or the torch attention backend take the
modules.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..layers.attention import SPAN_AS_DECODES
from ..layers.batch_rows_linear import BatchRowsLinear
from ..layers.linear import NativeLinear
from ..layers.native_decode import native_decode_kernel
from ..layers.native_ops import NATIVE_DTYPES, small_ops_kernel
from ..layers.norm import RMSNorm
from ..native_build import NativeExtension, build_extension
from ..quant.linear import QuantizedLinear
from .llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaMLP

SOURCE = Path(__file__).parent.parent / "layers" / "csrc" / "decode_stack.cpp"
STEM = "deepinfer_decode_stack"


@cache
def decode_stack_kernel() -> NativeExtension:
    """Build (once per machine) and load the stack; never raises. Its ops must load first: the
    stack finds them in the dispatcher when it is made."""
    for needed in (small_ops_kernel(), native_decode_kernel()):
        if not needed.loaded:
            return NativeExtension("", needed.error)
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_stack.isa())


class NativeDecodeStack:
    """A model's layers as the native stack holds them, and the test of which steps it runs."""

    def __init__(self, model: LlamaForCausalLM, stack: torch.ScriptObject, max_rows: int) -> None:
        self.embed = model.embed
        self.stack = stack
        self.max_rows = max_rows

    def runs(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a step the stack computes: decodes and spans short enough to run
        as decodes (verify spans, short prefill tails), on the paged caches."""
        return (0 < batch.num_tokens <= self.max_rows and all(s.q_len <= SPAN_AS_DECODES for s in batch.prefills)
                and batch.window_view is None and not batch.layer_loads and batch.attention_backend == "auto")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens (before the final norm), as
        ``model(batch, kv)`` computes them over the caches the stack was built with; writes
        their KV there."""
        spans = [n for s in batch.prefills for n in (s.q_start, s.q_len, s.kv_len, s.kv_start, s.kv_lo)]
        return self.stack.run(self.embed(batch.input_ids), batch.positions, batch.slot_mapping, batch.num_decodes,
                              batch.decode_pages, batch.decode_kv_lens, batch.decode_kv_start, batch.decode_kv_lo,
                              spans, [s.pages for s in batch.prefills])


def _linears(layer: DecoderLayer) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _native(linear: nn.Module) -> NativeLinear | None:
    if isinstance(linear, (QuantizedLinear, BatchRowsLinear)):
        return linear.native()
    return None


def _layer_fits(layer: nn.Module, dtype: torch.dtype) -> bool:
    """A plain pre-norm Llama block owning its cache, on the CPU in a dtype the ops take."""
    if not (isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, LlamaAttention)
            and isinstance(layer.mlp, LlamaMLP)):
        return False
    attn = layer.self_attn
    if attn.share_with is not None:  # (such a layer has no k projection, nor a k norm)
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm) + _head_norms(attn)
    return (not attn.rotary.interleaved
            and attn.rotary.rot_dim == attn.head_dim and attn.rotary.cos.is_cpu
            and all(not n.unit_offset and n.weight.is_cpu for n in norms) and dtype in NATIVE_DTYPES)


def _head_norms(attn: LlamaAttention) -> tuple[RMSNorm, ...]:
    """Qwen3's per-head q and k norms (none elsewhere)."""
    return (attn.q_norm, attn.k_norm) if attn.qk_norm else ()


def build_decode_stack(model: nn.Module, dtype: torch.dtype,
                       kv: list[dict[str, torch.Tensor]]) -> NativeDecodeStack | None:
    """The stack of ``model``'s layers (after the load-time kernel swaps) over their caches
    ``kv`` (the runner's, for good), or None where it does not apply (another family or layout,
    a linear without a native form, no native build)."""
    if not isinstance(model, LlamaForCausalLM):
        return None
    layers = list(model.model.layers)
    if not layers or not all(_layer_fits(layer, dtype) for layer in layers):
        return None
    natives = [[_native(m) for m in _linears(layer)] for layer in layers]
    if any(n is None for row in natives for n in row) or not decode_stack_kernel().loaded:
        return None
    first = layers[0].self_attn
    if any(layer.self_attn.rotary is not first.rotary for layer in layers):
        return None
    eps = {n.eps for layer in layers
           for n in (layer.input_layernorm, layer.post_attention_layernorm, *_head_norms(layer.self_attn))}
    if len(eps) != 1 or len({layer.self_attn.scale for layer in layers}) != 1:
        return None
    stack = torch.classes.deepinfer_stack.DecodeStack(first.rotary.cos, first.rotary.sin, eps.pop(),
                                                      first.head_dim, first.scale)
    for layer, linears, caches in zip(layers, natives, kv):
        attn = layer.self_attn
        head_norms = [n.weight.detach() for n in _head_norms(attn)] or [None, None]
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        *head_norms, caches["k"], caches["v"], *((n.op, n.args) for n in linears),
                        attn.num_heads, attn.num_kv_heads, attn.window)
    return NativeDecodeStack(model, stack, max_rows=min(n.max_rows for row in natives for n in row))
