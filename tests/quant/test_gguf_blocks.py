"""GGUF blocks -> quantized weights holding exactly the values gguf-py de-quantizes them to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from deepinfer.quant.gguf_blocks import block_row_order, concat_rows, from_blocks
from deepinfer.quant.weights import quantize_int4, quantize_int8


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q8_0", 4), ("Q4_0", 8), ("Q4_0", 4),
                                        ("Q4_1", 8), ("Q4_1", 4)])
def test_blocks_hold_the_gguf_values(qtype, bits):
    t = GGMLQuantizationType[qtype]
    blocks = quantize(np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32), t)
    want = torch.from_numpy(dequantize(blocks, t))
    w = from_blocks(qtype, blocks, bits)
    assert w.bits == (8 if qtype == "Q8_0" else bits) and w.shape == (6, 96)
    got = w.dequantize(torch.float32)
    if qtype == "Q4_0" and bits == 4:  # d * q - 8 * d instead of d * (q - 8): last-bit rounding
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_row_order_of_a_processor():
    assert block_row_order(lambda w: w, 8) is None
    assert block_row_order(lambda w: w[::-1], 4) == [3, 2, 1, 0]
    assert block_row_order(lambda w: w - 1, 4) is False  # changes values: not loadable as blocks


def test_concat_rows_of_mixed_shards():
    a, b = quantize_int8(torch.randn(4, 64)), quantize_int4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="different quantization formats"):
        concat_rows([a, b])
    c = from_blocks("Q8_0", quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q8_0), 8)
    fused = concat_rows([a, c])  # asymmetric + symmetric: offsets of zero for the latter
    assert torch.equal(fused.dequantize(torch.float32),
                       torch.cat([a.dequantize(torch.float32), c.dequantize(torch.float32)]))
