"""Quantized checkpoints: DeepSeek-V3 FP8 (block-wise scales) and gpt-oss MXFP4 experts.

The test quantizes tiny random models itself and writes two folders: the quantized checkpoint, which
deepinfer loads, and the same weights de-quantized, which transformers loads as the reference.
"""

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from deepinfer.llm import LLM
from deepinfer.loader import load_checkpoint
from deepinfer.loader.quantized import dequantized
from model_check import hf_logits, make_runner, run_prompt_logits
from tiny_checkpoints import make_tokenizer

import test_deepseek
import test_gpt_oss

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
BLOCK = (16, 32)  # small, non-square fp8 blocks: several per tensor, partial ones at the edges
FP8_MAX = 448.0  # largest float8_e4m3fn


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-style e4m3 with one scale per block (block amax / 448): (fp8, scale_inv, de-quantized)."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block[1], 0, -rows % block[0]))
    amax = padded.unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0])).abs().amax(dim=(1, 3))
    scale_inv = amax.clamp(min=1e-12) / FP8_MAX
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale_inv, q.float() * full


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (blocks [E, out, in/32, 16], E8M0 scales [E, out, in/32], de-quantized [E, out, in])."""
    groups = w.unflatten(-1, (-1, 32))
    exp = torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6).ceil()  # |w| / 2**exp <= 6
    lut = torch.tensor(FP4_VALUES)
    codes = (groups / exp.exp2()[..., None]).unsqueeze(-1).sub(lut).abs().argmin(-1)  # nearest e2m1
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)  # even element: low nibble
    return blocks, (exp + 127).to(torch.uint8), (lut[codes] * exp.exp2()[..., None]).flatten(-2)


def fp8_deepseek() -> tuple:
    """Official V3 layout: one tensor per expert; every linear weight but the router quantized."""
    model = test_deepseek.tiny_v3(24, test_deepseek.YARN)
    weights = test_deepseek.per_expert_checkpoint(model.state_dict(), model.config.num_hidden_layers)
    stored, expected = {}, {}
    for name, t in weights.items():
        if t.dim() == 2 and not re.search(r"embed_tokens|lm_head|mlp\.gate\.weight", name):
            stored[name], stored[f"{name}_scale_inv"], t = quantize_fp8(t, BLOCK)
        else:
            stored[name] = t
        expected[name] = t
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(BLOCK)}
    return model.config, stored, expected, quant


def mxfp4_gpt_oss() -> tuple:
    """Official gpt-oss layout: experts' [E, in, out] weights stored transposed, as blocks + scales."""
    model = test_gpt_oss.tiny_gpt_oss()
    stored, expected = {}, {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[f"{name}_blocks"], stored[f"{name}_scales"], t = quantize_mxfp4(t.transpose(1, 2))
            t = t.transpose(1, 2)
        else:
            stored[name] = t
        expected[name] = t
    return model.config, stored, expected, {"quant_method": "mxfp4"}


def write_folder(path: Path, config, tensors: dict[str, torch.Tensor], quant: dict | None = None) -> Path:
    config = copy.deepcopy(config)
    if quant is not None:
        config.quantization_config = quant
    config.save_pretrained(path)
    save_file({n: t.contiguous().clone() for n, t in tensors.items()}, str(path / "model.safetensors"))
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[fp8_deepseek, mxfp4_gpt_oss], ids=["fp8", "mxfp4"])
def case(request, tmp_path_factory):
    """(quantized folder, its weights de-quantized by the test, transformers on those weights)."""
    config, stored, expected, quant = request.param()
    root = tmp_path_factory.mktemp(request.param.__name__)
    quantized = write_folder(root / "quantized", config, stored, quant)
    reference = AutoModelForCausalLM.from_pretrained(write_folder(root / "dequantized", config, expected))
    return quantized, expected, reference.eval()


def test_dequantized_tensors_equal_the_reference(case):
    folder, expected, _ = case
    ckpt = load_checkpoint(folder)
    got = dict(dequantized(ckpt.config, ckpt.weights(), torch.float32))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_logits_match_transformers(case):
    folder, _, reference = case
    ours = run_prompt_logits(make_runner(reference, ckpt=load_checkpoint(folder)), test_deepseek.PROMPT)
    assert (ours - hf_logits(reference, test_deepseek.PROMPT)).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_unpacks_like_transformers(dtype):
    """Element order, nibble order and the transpose, against transformers' own converter."""
    config, stored, _, quant = mxfp4_gpt_oss()
    config.quantization_config = quant
    got = dict(dequantized(config, stored.items(), dtype))
    for name in [n.removesuffix("_blocks") for n in stored if n.endswith("_blocks")]:
        ref = convert_moe_packed_tensors(stored[f"{name}_blocks"], stored[f"{name}_scales"], dtype=dtype)
        assert torch.equal(got[name], ref), name


def test_bf16_rounds_once_and_keeps_the_router_fp32(case):
    """LLM(path) runs the quantized checkpoint in bf16. Weights hold the checkpoint's values rounded
    once to bf16; DeepSeek's router weight and score bias stay float32 and exact (bf16 rounding of
    the bias changes which experts are picked)."""
    folder, expected, _ = case
    llm = LLM(model=str(folder), dtype="bfloat16", device="cpu", page_size=4, num_pages=64, progress=False)
    assert len(llm.generate(test_deepseek.PROMPT)[0].token_ids) > 0
    model = llm.engine.runner.model
    params = dict(model.named_parameters())
    kept = {n for n in params if any(re.search(p, n) for p in model.fp32_params)}
    assert {n for n in expected if n.endswith("e_score_correction_bias")} <= kept
    for name, p in params.items():
        assert p.dtype == (torch.float32 if name in kept else torch.bfloat16), name
        if name in expected:  # loaded by name (not fused or stacked)
            assert torch.equal(p, expected[name].to(p.dtype)), name


def test_unsupported_method_is_named(case, tmp_path):
    folder = shutil.copytree(case[0], tmp_path / "awq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported quantization method 'awq'"):
        LLM(model=str(folder), device="cpu", progress=False)
