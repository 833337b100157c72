"""De-quantizing quantized checkpoints while their weights stream into the model.

Supported ``quantization_config.quant_method`` values:

- ``"fp8"`` (DeepSeek-V3/R1): ``X.weight`` in float8_e4m3fn with ``X.weight_scale_inv`` (float32),
  one scale per ``weight_block_size`` block (edge blocks may be partial); weight = value * scale.
- ``"fp8"`` as DeepSeek-V4 ships it: ``X.weight`` in float8_e4m3fn (block scales) or, for MoE
  experts, int8 holding two e2m1 FP4 values per byte (low nibble first, ``[out, in / 2]``, one scale
  per 32 values of a row), with ``X.scale`` in float8_e8m0fnu (powers of two); weight = value * scale.
- ``"mxfp4"`` (gpt-oss MoE experts): ``X_blocks`` (uint8, two e2m1 values per byte, low nibble
  first) with ``X_scales`` (uint8 E8M0 exponents, 2 ** (s - 127), one per 32 values), stored
  ``[..., out, in / 32, 16]``; the model (like transformers) keeps the transpose ``[..., in, out]``.

Why de-quantize instead of running quantized matmuls: PyTorch has no FP8/FP4 matmul kernels on CPU
(and only on some GPUs), while de-quantized weights run on every device with the model code as it
is. It costs memory (2 bytes per weight in bf16), not accuracy: the values are exactly the
checkpoint's, rounded once to the model dtype.

A quantized tensor and its scales are paired as they stream past. Official checkpoints keep each
pair side by side in one shard, so only one pair is held at a time, never a second model copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PretrainedConfig

Weights = Iterable[tuple[str, torch.Tensor]]

# e2m1 value of each 4-bit code (sign bit, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float8 ``[..., rows, cols]`` times the float32 scale of its ``block`` -> ``dtype``."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(f"fp8 weight {tuple(weight.shape)} with blocks {block} needs scales {grid}, "
                         f"got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], -1)[..., :cols]
    return weight.float().mul_(scale).to(dtype)


def dequantize_deepseek_v4(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """V4 ``X.weight`` + e8m0 ``X.scale``: FP8 with block scales, or int8-packed FP4 experts."""
    if values.dtype != torch.int8:
        return dequantize_fp8(values, scale, dtype, block)
    codes = values.view(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=values.device)
    unpacked = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)
    group = unpacked.shape[-1] // scale.shape[-1]
    return unpacked.mul_(scale.float().repeat_interleave(group, -1)).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., out, G, 16]`` packed e2m1 + ``[..., out, G]`` exponents -> ``[..., G * 32, out]`` in ``dtype``.

    Same values and order as transformers' ``convert_moe_packed_tensors``; one expert at a time,
    so the temporaries stay small.
    """
    *lead, rows, groups, width = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*lead, groups * width * 2, rows, dtype=dtype, device=blocks.device)
    for i in itertools.product(*map(range, lead)):
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).long()  # [out, G, 16, 2]
        values = torch.ldexp(lut[codes], scales[i].int()[..., None, None] - 127)
        out[i] = values.reshape(rows, -1).T
    return out


@dataclass(frozen=True)
class QuantFormat:
    """How one method names a quantized tensor and its scales: ``stem + data_suffix`` holds the
    values (in one of ``data_dtypes``: fp8 checkpoints also hold unquantized ``.weight``s), ``stem
    + scale_suffix`` the scales (in one of ``scale_dtypes``, None = any), and the de-quantized
    tensor is named ``stem + out_suffix``."""

    data_suffix: str
    data_dtypes: tuple[torch.dtype, ...]
    scale_suffix: str
    out_suffix: str
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    scale_dtypes: tuple[torch.dtype, ...] | None = None

    def is_scale(self, name: str, tensor: torch.Tensor) -> bool:
        return name.endswith(self.scale_suffix) and (self.scale_dtypes is None or tensor.dtype in self.scale_dtypes)

    def is_values(self, name: str, tensor: torch.Tensor) -> bool:
        return name.endswith(self.data_suffix) and tensor.dtype in self.data_dtypes


def quant_formats(config: PretrainedConfig) -> list[QuantFormat]:
    """The formats the config's ``quantization_config`` declares (none when there is none)."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return []
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is None:
            raise ValueError("fp8 checkpoints without weight_block_size (per-tensor scales) are not "
                             "supported; only block-wise scales (DeepSeek-V3 style) are")
        block = tuple(block)
        return [QuantFormat(".weight", (torch.float8_e4m3fn,), ".weight_scale_inv", ".weight",
                            partial(dequantize_fp8, block=block)),
                # DeepSeek-V4's names: ".scale" in e8m0 (other ".scale" tensors are parameters)
                QuantFormat(".weight", (torch.float8_e4m3fn, torch.int8), ".scale", ".weight",
                            partial(dequantize_deepseek_v4, block=block), (torch.float8_e8m0fnu,))]
    if method == "mxfp4":
        return [QuantFormat("_blocks", (torch.uint8,), "_scales", "", dequantize_mxfp4)]
    raise ValueError(f"unsupported quantization method {method!r} (config.json quantization_config); "
                     "deepinfer de-quantizes only 'fp8' (block-wise) and 'mxfp4' checkpoints")


def dequantized(config: PretrainedConfig, weights: Weights, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each quantized tensor and its scales replaced by the de-quantized tensor in
    ``dtype``; other tensors pass unchanged. Raises here, before any weight is read, on an
    unsupported method."""
    formats = quant_formats(config)
    return _paired(formats, weights, dtype) if formats else iter(weights)


def _paired(formats: list[QuantFormat], weights: Weights,
            dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    # stem -> [values, scales, format of the scales], until both arrive
    pending: dict[str, list] = {}
    for name, tensor in weights:
        scale_fmt = next((f for f in formats if f.is_scale(name, tensor)), None)
        values_fmt = None if scale_fmt else next((f for f in formats if f.is_values(name, tensor)), None)
        if scale_fmt is not None:
            stem, half = name.removesuffix(scale_fmt.scale_suffix), 1
        elif values_fmt is not None:
            stem, half = name.removesuffix(values_fmt.data_suffix), 0
        else:
            yield name, tensor
            continue
        pair = pending.setdefault(stem, [None, None, None])
        pair[half] = tensor
        if scale_fmt is not None:
            pair[2] = scale_fmt
        if pair[0] is not None and pair[1] is not None:
            del pending[stem]
            fmt = pair[2]
            yield stem + fmt.out_suffix, fmt.dequantize(pair[0], pair[1], dtype)
    if pending:
        raise ValueError(f"quantized tensors without their values or scales: {sorted(pending)[:4]}")
