"""GGUF Q4_0 / Q4_1 / Q8_0 blocks straight into ``QuantizedWeight``s, never through float.

The GGUF conversion (``loader/gguf_convert.py``) writes ``gguf_blocks.json`` next to the float
copy: for each block-quantized 2-D tensor, its HF name, GGUF name and type, and the row order
transformers' tensor processor applies (Llama's Q/K un-permutation reorders rows only, so it
applies to whole rows of blocks alike). Blocks of 32 along a row (ggml layout):

- Q8_0: fp16 ``d``, 32 int8 ``q``: ``w = d * q``
- Q4_0: fp16 ``d``, 16 bytes of nibbles: ``w = d * (q - 8)``
- Q4_1: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles: ``w = d * q + m``

(byte j of the 16 holds value j in its low nibble and value j + 16 in its high one: our int4
packing, so Q4 nibbles are kept as they are).

Under ``--quantization int4`` a Q8_0 tensor stays int8: the GGUF's maker chose 8 bits for it (as
llama.cpp's Q4 presets do for SmolLM2's embedding, which is also its LM head), and 4 bits would
lose what it kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import torch

from .weights import GROUP, QuantizedWeight

if TYPE_CHECKING:
    from ..models.base import CausalLM

BLOCKS_FILE = "gguf_blocks.json"
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def block_row_order(process, rows: int) -> list[int] | None | bool:
    """The row order ``process`` (weights -> processed weights) applies: None if it keeps rows as
    they are, False if it does more than reorder rows (then the tensor is not loadable as blocks)."""
    index = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    out = np.asarray(process(index))
    if out.shape != (rows, 1) or sorted(out[:, 0].tolist()) != list(range(rows)):
        return False
    order = out[:, 0].astype(np.int64).tolist()
    return None if order == list(range(rows)) else order


def from_blocks(qtype: str, blocks: np.ndarray, bits: int) -> QuantizedWeight:
    """uint8 [rows, row_bytes] of ``qtype`` blocks -> the same values as a ``bits`` weight
    (Q8_0: always int8)."""
    rows = blocks.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    b = torch.from_numpy(np.array(blocks)).view(rows, -1, size)  # a copy: the GGUF map is read-only
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        return QuantizedWeight(q, d, None, 8, GROUP)
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if qtype == "Q4_1" else None
    nib = b[..., size - 16:].reshape(rows, -1)  # already our int4 packing
    if bits == 4:
        return QuantizedWeight(nib.contiguous(), d, -8 * d if m is None else m, 4, GROUP)
    q = QuantizedWeight(nib, d, m, 4, GROUP).values().to(torch.int8)  # 0..15, column order
    return QuantizedWeight(q - 8 if m is None else q, d, m, 8, GROUP)


def gguf_weights(folder: Path, gguf: Path, bits: int) -> dict[str, QuantizedWeight]:
    """HF tensor name -> the weight of each block-quantized tensor of ``gguf``, exactly its values."""
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict

    index = folder / BLOCKS_FILE
    if not index.is_file():
        return {}
    entries = json.loads(index.read_text())["tensors"]
    header = GgufHeader.from_file(str(gguf))  # its tensor table only, not the vocabulary
    shapes = {info.name: info.shape for info in header.tensors}
    raw = load_gguf_state_dict(header)
    out = {}
    for hf_name, e in entries.items():
        blocks = np.asarray(raw[e["gguf"]].data).reshape(shapes[e["gguf"]][0], -1)  # [rows, row_bytes]
        if e["rows"] is not None:
            blocks = blocks[e["rows"]]
        out[hf_name] = from_blocks(e["type"], blocks, bits)
    return out


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Shards of a fused layer (q|k|v, gate|up) stacked along the output rows."""
    first = parts[0]
    if any(p.bits != first.bits or p.group != first.group for p in parts):
        raise ValueError("fused shards of different quantization formats")
    offsets = None
    if any(p.offset is not None for p in parts):
        offsets = torch.cat([torch.zeros_like(p.scale) if p.offset is None else p.offset for p in parts])
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           offsets, first.bits, first.group)


def linear_weights(model: CausalLM, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """HF tensor names -> the names of ``model``'s linear modules: fused shards stacked (only when
    every shard is present), a tied LM head given the embedding's weight."""
    out: dict[str, QuantizedWeight] = {}
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    for name, w in weights.items():
        target = model.map_weight_name(name)
        if target is None or not target.endswith(".weight"):
            continue
        target = target.removesuffix(".weight")
        for frag, (fused, index) in model.fused_shards.items():
            if f".{frag}" in target + ".":
                shards.setdefault(target.replace(f".{frag}", f".{fused}"), {})[index] = w
                break
        else:
            out[target] = w
    for module, parts in shards.items():
        if len(parts) == len(model.get_submodule(module).out_sizes):
            out[module] = concat_rows([parts[i] for i in range(len(parts))])
    if model.tied_embeddings() and "model.embed_tokens" in out:
        out["lm_head"] = out["model.embed_tokens"]
    return out
