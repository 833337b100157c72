"""A Llama-family decode step runs exactly the ops this file spells out, with the same arguments:
the decoder's hidden states equal, bit for bit, those of the op sequence below (the glue of the
layers is cut for speed; what it calls must not move), in bfloat16 and float32, at 1, 8 and 32
decodes, with q/k/v biases (Qwen2), q/k norms (Qwen3) and with int8 and int4 weights; and so do the native decode
stack's (``models/llama_native.py``) wherever it is built."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen3Config

from deepinfer.layers.batch_rows_linear import BatchRowsLinear, batch_rows_usable
from deepinfer.layers.prepacked_linear import PrepackedLinear
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from native_helpers import loaded
from tiny_checkpoints import make_checkpoint, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 21  # cached tokens of each decoding sequence (pages filled with random K/V)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return make_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), cfg)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return make_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), cfg)


def head_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of x [T, heads, D]: one row per head."""
    return torch.ops.deepinfer_ops.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), norm.weight,
                                            norm.eps).view(x.shape)


def linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The batch-rows kernel on its packed weight; oneDNN on its packed weight from ``min_rows``
    rows, else the wrapped layer's own kernel."""
    if isinstance(layer, BatchRowsLinear):
        return torch.ops.deepinfer_batch.linear(x, layer.packed, layer.packed_bias, layer.out_features)
    if isinstance(layer, PrepackedLinear) and x.shape[0] >= layer.min_rows:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.inner.bias, "none", [], "")
    return layer(x)


def reference_layer(layer, x: torch.Tensor, batch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
    attn, mlp, T = layer.self_attn, layer.mlp, x.shape[0]
    ops = torch.ops.deepinfer_ops
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    h = ops.rms_norm(x, norm1.weight, norm1.eps)
    q, k, v = (t.view(T, -1, attn.head_dim) for t in linear(attn.qkv_proj, h).split(attn.qkv_proj.out_sizes, -1))
    if attn.qk_norm:
        q, k = head_norm(attn.q_norm, q), head_norm(attn.k_norm, k)
    q, k = ops.rotate_store(q, k, v, attn.rotary.cos, attn.rotary.sin, batch.positions, kv["k"], kv["v"],
                            batch.slot_mapping)
    o = torch.ops.deepinfer_attention.paged_decode(q, kv["k"], kv["v"], batch.decode_pages, batch.decode_kv_lens,
                                                   None, None, None, attn.scale)
    x, h = ops.add_rms_norm(x, linear(attn.o_proj, o.reshape(T, -1)), norm2.weight, norm2.eps)
    gate_up = linear(mlp.gate_up_proj, h)
    if x.dtype == torch.bfloat16:
        act = ops.silu_mul(gate_up)
    else:  # float32 keeps torch's ops (native_ops.silu_mul)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return x + linear(mlp.down_proj, act)


@pytest.mark.parametrize("batch_size", [1, 8, 32])
@pytest.mark.parametrize("dtype,quantization,family", [
    ("bfloat16", "none", "llama"), ("float32", "none", "llama"),
    ("bfloat16", "none", "qwen2"), ("bfloat16", "int8", "llama"), ("float32", "int4", "qwen2"),
    ("bfloat16", "int4", "qwen3"),
])
def test_decode_step_runs_the_spelled_out_ops(request, native_kernels, tiny_llama, dtype, quantization,
                                              family, batch_size):
    for kernel in native_kernels[:2]:  # paged decode attention, small ops
        loaded(kernel)
    path = tiny_llama if family == "llama" else request.getfixturevalue(f"tiny_{family}")
    llm = LLM(str(path), dtype=dtype, quantization=quantization, progress=False, host_cache_gb=0,
              enable_disk_cache=False, page_size=16, num_pages=(batch_size + 1) * 4)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(batch_size)
    for buf in runner.pool.owned_buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    items = []
    for b in range(batch_size):
        req = Request(f"r{b}", torch.randint(0, 300, (CONTEXT + 1,), generator=gen).tolist(), SamplingParams())
        req.pages = runner.pool.allocator.alloc(2)
        req.num_computed_tokens = CONTEXT
        items.append((req, 1))
    model = runner.model
    with torch.inference_mode():
        batch = runner.prepare(items).batch
        ours = model(batch, runner.kv_buffers)
        stack = runner.decode_stack.forward(batch) if runner.decode_stack else None
        x = model.embed(batch.input_ids)
        for layer, kv in zip(model.model.layers, runner.kv_buffers):
            x = reference_layer(layer, x, batch, kv)
    assert ours.dtype == getattr(torch, dtype)
    assert torch.equal(ours, x)
    # every linear with a native form: quantized, or bf16 on the batch-rows kernel
    assert (stack is not None) == (quantization != "none" or (dtype == "bfloat16" and batch_rows_usable()))
    if stack is not None:
        assert runner.decode_stack.runs(batch)
        assert torch.equal(stack, x)
