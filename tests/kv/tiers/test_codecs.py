"""KV page codecs: exact sizes, derived error bounds, edge values, bytes round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deepinfer.kv.tiers import page_bytes
from deepinfer.kv.tiers.codecs import CODEC_NAMES, PAGE_AWARE, FP4Codec, FP8Codec, get_codec
from deepinfer.kv.tiers.minifloat import E2M1, E4M3, e2m1_decode_packed, e4m3_decode
from deepinfer.kv.tiers.page_bytes import decode_pages, encode_pages

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QUANT = ["fp8", "fp4", "mxfp4"]
ROW_CODECS = [n for n in CODEC_NAMES if n not in PAGE_AWARE]  # any row length; fp8c: below


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    c = get_codec(name)
    data = c.encode(x)
    assert isinstance(data, bytes)
    assert len(data) == c.encoded_nbytes(x.shape, x.dtype)
    y = c.decode(data, x.shape, x.dtype, "cpu")
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def out_slack(y: torch.Tensor) -> torch.Tensor:
    """Rounding of the float32 dequantised value into the output dtype (incl. its subnormals)."""
    fi = torch.finfo(y.dtype)
    return y.float().abs() * fi.eps + fi.tiny * fi.eps


# ---- bounds, derived from each format (values are in block-scaled units, s = the block scale):
# e4m3: in binade [2^e, 2^(e+1)), e >= -6, the step is 2^(e-3) so RNE errs by <= 2^(e-4) <= |xs|/16;
#       below 2^-6 (subnormals) the step is 2^-9, error <= 2^-10. Hence |x - x^| <= max(|x|/16, s/1024).
# e2m1: grid 0,.5,1,1.5,2,3,4,6. In binade [2^e, 2^(e+1)), e >= 0, the step is 2^(e-1): error
#       <= 2^(e-2) <= |xs|/4; below 1 the step is 0.5: error <= 0.25. Hence <= max(|x|/4, s/4).
# Where the fp32 scale itself is subnormal it holds only 2^-149 of absolute precision, so a code c
# decodes up to |c| * 2^-149 away on top (SUBNORMAL_SCALE_SLACK, for the largest code).
SUBNORMAL_SCALE_SLACK = 448 * 6 * 2.0**-149


def fp8_bound(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    xb = x.float().reshape(-1, block)
    s = xb.abs().amax(1, keepdim=True) / 448
    bound = torch.maximum(xb.abs() / 16, s / 1024) * (1 + 2**-20) + s * 2**-20 + SUBNORMAL_SCALE_SLACK
    return bound.reshape(x.shape) + out_slack(y)


def fp4_bound(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    """NVFP4-like: the e4m3 block scale s_used differs from s = amax_b/6 by d <= max(s/16, g/1024)
    (e4m3 RNE on s/g, normal or subnormal). Unclipped elements err by <= max(|x|/4, s_used/4);
    clipped ones (|x| > 6 s_used) decode to 6 s_used and err by <= amax_b - 6 s_used <= 6d."""
    xb = x.float().reshape(-1, block)
    amax_b = xb.abs().amax(1, keepdim=True)
    g = amax_b.max() / (448 * 6)
    s = amax_b / 6
    d = torch.maximum(s / 16, g / 1024)
    bound = torch.maximum(xb.abs() / 4, (s + d) / 4) + 6 * d
    bound = bound * (1 + 2**-18) + amax_b.max() * 2**-22 + SUBNORMAL_SCALE_SLACK
    return bound.reshape(x.shape) + out_slack(y)


def mxfp4_bound(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    """scale = 2^ceil(log2(amax/6)) (floored at 2^-126) so amax/scale is in (3, 6]: no clipping,
    error <= max(|x|/4, scale/4) with scale < amax/3."""
    xb = x.float().reshape(-1, block)
    amax_b = xb.abs().amax(1, keepdim=True)
    scale = torch.clamp(amax_b / 3, min=2.0**-126)
    bound = torch.maximum(xb.abs() / 4, scale / 4) * (1 + 2**-18) + amax_b * 2**-22
    return bound.reshape(x.shape) + out_slack(y)


BOUNDS = {"fp8": (fp8_bound, 32), "fp4": (fp4_bound, 16), "mxfp4": (mxfp4_bound, 32)}


def assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    fn, block = BOUNDS[name]
    err = (x.float() - y.float()).abs()
    bound = fn(x, y, block)
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: error exceeds derived bound by {worst}"


# ------------------------------------------------------------------------------ basics


def test_unknown_codec_lists_valid_names() -> None:
    with pytest.raises(ValueError) as e:
        get_codec("int3")
    for n in CODEC_NAMES:
        assert n in str(e.value)
    assert set(CODEC_NAMES) == {"lossless", "fp8", "fp8c", "fp4", "mxfp4"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_exact(dtype: torch.dtype) -> None:
    x = torch.randn(4, 3, 2, 64).to(dtype)
    y = roundtrip("lossless", x)
    assert torch.equal(x, y)
    assert len(get_codec("lossless").encode(x)) == x.numel() * x.element_size()


def test_lossless_preserves_special_values() -> None:
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38])
    y = roundtrip("lossless", x)
    assert torch.equal(torch.signbit(x), torch.signbit(y)) and torch.equal(x, y)


@pytest.mark.parametrize(
    "name,bytes_per_elem,per_page",
    [("lossless", None, 0), ("fp8", 1 + 4 / 32, 0), ("fp4", 0.5 + 1 / 16, 4), ("mxfp4", 0.5 + 1 / 32, 0)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoded_size(name: str, bytes_per_elem: float | None, per_page: int, dtype: torch.dtype) -> None:
    shape = (16, 8, 128)  # one page: 16 tokens, 8 kv heads, head dim 128
    c = get_codec(name)
    n = math.prod(shape)
    want = n * torch.empty((), dtype=dtype).element_size() if bytes_per_elem is None else n * bytes_per_elem + per_page
    assert c.encoded_nbytes(shape, dtype) == want
    assert len(c.encode(torch.randn(shape).to(dtype))) == want


@pytest.mark.parametrize("name", QUANT)
def test_bad_last_dim_rejected(name: str) -> None:
    c = get_codec(name)
    with pytest.raises(ValueError):
        c.encode(torch.randn(4, 24))
    with pytest.raises(ValueError):
        c.encoded_nbytes((4, 24), torch.float32)


@pytest.mark.parametrize("name", ROW_CODECS)
def test_decode_wrong_length_rejected(name: str) -> None:
    c = get_codec(name)
    data = c.encode(torch.randn(2, 64))
    with pytest.raises(ValueError):
        c.decode(data[:-1], (2, 64), torch.float32, "cpu")


@pytest.mark.parametrize("name", QUANT)
def test_non_finite_rejected(name: str) -> None:
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError):
        get_codec(name).encode(x)


def test_block_size_configurable() -> None:
    c = get_codec("fp8", block_size=64)
    assert c.block_size == 64 and c.tag == "fp8-b64"
    assert c.encoded_nbytes((2, 64), torch.float16) == 128 + 2 * 4
    x = torch.randn(2, 64)
    err = (x - c.decode(c.encode(x), x.shape, x.dtype)).abs()
    assert (err <= x.abs() / 16 + 1e-6).all()


# ------------------------------------------------------------------------------ error bounds


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_bound_random_normal(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8, 128).to(dtype)
    y = roundtrip(name, x)
    assert_within_bound(name, x, y)


@pytest.mark.parametrize("name,block_rel_max", [("fp8", 16 / 448), ("fp4", (1 + 2**-4) / 6), ("mxfp4", 1 / 4)])
def test_block_error_relative_to_amax(name: str, block_rel_max: float) -> None:
    """Per block, max |x - x^| / amax_block: fp8 <= half the top e4m3 step (16/448); NVFP4-like
    <= (1+2^-4)/6 (a half-step of 1 at the top, scale rounded by <= 2^-4); MXFP4 <= 1/4."""
    torch.manual_seed(1)
    block = get_codec(name).block_size
    # Blocks of very different size. The ratio stays below 448 / 2^-6 = 28672, the range in which
    # fp4's per-page float32 scale keeps every e4m3 block scale normal (see the codecs docstring).
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]
    y = roundtrip(name, x)
    xb, yb = x.reshape(-1, block), y.reshape(-1, block)
    rel = (xb - yb).abs().amax(1) / xb.abs().amax(1)
    assert rel.max().item() <= block_rel_max * (1 + 1e-6)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_constant_blocks(name: str, dtype: torch.dtype) -> None:
    x = torch.zeros(4, 64, dtype=dtype)
    assert torch.equal(roundtrip(name, x), x)
    # A constant block: |c| is the block amax, which e4m3 hits exactly (448) and e2m1 maps to a
    # grid point (6 for NVFP4 up to the e4m3 scale, a power of two times 4 or 6 for MXFP4).
    x = torch.full((4, 64), -0.75, dtype=dtype)
    x[1] = 3.0
    y = roundtrip(name, x)
    assert_within_bound(name, x, y)
    if name != "fp4":  # fp4's e4m3 block scale may round; fp8 and mxfp4 reproduce these exactly
        assert torch.equal(y, x)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_and_tiny_values(name: str, dtype: torch.dtype) -> None:
    fi = torch.finfo(dtype)
    x = torch.randn(4, 64, dtype=torch.float32)
    x[0] = x[0].sign() * fi.max * torch.rand(64) * 0.999
    x[0, 5] = fi.max
    x[1] *= fi.tiny * 4
    x[2, :32] *= 1e-3
    x = x.to(dtype)
    y = roundtrip(name, x)
    assert torch.isfinite(y).all()
    assert_within_bound(name, x, y)


def test_fp8_native_matches_table_path() -> None:
    """The pure-torch table path (fallback without torch.float8_e4m3fn) is bit-identical."""
    torch.manual_seed(2)
    x = torch.randn(64, 256) * torch.logspace(-6, 6, 256)
    # exact ties between e4m3 neighbours: 1 + 1/16 (-> 1.0) and 1 + 3/16 (-> 1.25), scaled to amax 448
    x[0, :32] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10] + [0.0] * 26)
    for cls in (FP8Codec, FP4Codec):
        native, table = cls(native=True), cls(native=False)
        assert native.encode(x) == table.encode(x)
        data = table.encode(x)
        assert torch.equal(native.decode(data, x.shape, x.dtype), table.decode(data, x.shape, x.dtype))
    y = roundtrip("fp8", x[:1, :32])
    assert y[0, :6].tolist() == [448.0, 1.0, 1.25, -1.0, 0.0, 2.0**-8]  # round half to even


def test_fp4_grid_round_half_even() -> None:
    """MXFP4 with amax 6 has scale 1, so values map onto the e2m1 grid directly."""
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 4.9, 0.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 4.0, 0.0]
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = torch.tensor(vals)
    y = roundtrip("mxfp4", x)
    assert y[0, : len(vals)].tolist() == want


def test_encode_to_tensor_stays_on_device() -> None:
    c = get_codec("fp4")
    x = torch.randn(8, 64)
    buf = c.encode_to_tensor(x)
    assert buf.dtype == torch.uint8 and buf.device == x.device
    assert buf.numel() == c.encoded_nbytes(x.shape, x.dtype)
    assert torch.equal(c.decode_from_tensor(buf, x.shape, x.dtype), c.decode(c.encode(x), x.shape, x.dtype))


# ------------------------------------------------------------------------------ property test


@st.composite
def pages(draw: st.DrawFn) -> tuple[str, torch.Tensor]:
    name = draw(st.sampled_from(ROW_CODECS))
    dtype = draw(st.sampled_from(DTYPES))
    block = get_codec(name).block_size
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    shape = (*lead, block * draw(st.integers(1, 3)))
    limit = float(torch.finfo(dtype).max)
    elems = st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=32)
    arr = draw(hnp.arrays(np.float32, shape, elements=elems))
    return name, torch.from_numpy(arr).to(dtype)


@settings(max_examples=150, deadline=None)
@given(pages())
def test_roundtrip_property(page: tuple[str, torch.Tensor]) -> None:
    name, x = page
    y = roundtrip(name, x)
    if name == "lossless":
        assert torch.equal(x, y)
    else:
        assert_within_bound(name, x, y)


@pytest.mark.parametrize("name", ROW_CODECS)
def test_non_contiguous_input(name: str) -> None:
    x = torch.randn(64, 4, 8).permute(2, 1, 0)  # e.g. a strided slice of a pool buffer
    assert not x.is_contiguous()
    c = get_codec(name)
    assert c.encode(x) == c.encode(x.contiguous())


# ------------------------------------------------------------------------------ fp8c (page-aware)


def offset_pages(n: int, tokens: int, channels: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Pages like keys: per-channel offsets much larger than the variation, one outlier token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, tokens, channels, generator=g) + 6 * torch.randn(1, 1, channels, generator=g)
    x[:, 0] = 30 * torch.randn(n, channels, generator=g)  # an attention-sink-like token
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8c_layout_exact_token_and_bound(dtype: torch.dtype) -> None:
    tokens, channels = 16, 96
    c = get_codec("fp8c", page_size=tokens)
    x = offset_pages(3, tokens, channels, dtype)
    rows = c.encode_rows(x.reshape(3, -1))
    esz = torch.empty((), dtype=dtype).element_size()
    m = tokens * channels
    assert rows.shape == (3, m + m // 32 * 4 + channels * (2 + esz) + 2)
    assert rows.shape[1] == c.encoded_nbytes((m,), dtype)
    y = c.decode_rows(rows, m, dtype).reshape(x.shape)
    assert y.dtype == dtype and torch.equal(y[:, 0], x[:, 0])  # the farthest token is exact
    # the rest: fp8's per-block bound, on the deviations from the (bfloat16) page mean
    mean = x.float().mean(dim=1, keepdim=True).to(torch.bfloat16).float()
    dev = (x.float() - mean).reshape(3, -1, 32)
    bound = (dev.abs().amax(dim=-1, keepdim=True) * 16 / 448).expand_as(dev).reshape(x.shape)
    err = (y.float() - x.float()).abs()
    assert bool((err <= bound + out_slack(y) + 1e-6).all())
    # single-page API = row API, byte for byte
    assert c.encode(x[1].reshape(-1)) == bytes(rows[1].numpy().tobytes())
    assert torch.equal(c.decode(c.encode(x[1].reshape(-1)), (m,), dtype, "cpu"), y[1].reshape(-1))


def test_fp8c_beats_fp8_on_offset_channels() -> None:
    x = offset_pages(8, 16, 64, torch.float32, seed=1).reshape(8, -1)
    errs = {}
    for name in ("fp8", "fp8c"):
        c = get_codec(name, page_size=16)
        errs[name] = float((c.decode_rows(c.encode_rows(x), x.shape[1], x.dtype) - x).abs().mean())
    assert errs["fp8c"] < errs["fp8"] / 2


def test_fp8c_needs_whole_pages() -> None:
    with pytest.raises(ValueError, match="page size"):
        get_codec("fp8c")
    with pytest.raises(ValueError, match="tokens"):  # whole fp8 blocks, but not whole tokens
        get_codec("fp8c", page_size=48).encode_rows(torch.randn(2, 64))
    c = get_codec("fp8c", page_size=16)
    x = offset_pages(2, 16, 32, torch.float32).reshape(2, -1)
    x[1, 5] = float("inf")
    with pytest.raises(ValueError):
        c.encode_rows(x)


def test_decode_tables_hold_the_direct_conversions_values() -> None:
    """Decoding is a gather from per-code tables: for every byte, bit for bit what the direct
    conversion (float8_e4m3fn to float32, the e4m3 / e2m1 grids) gives."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - NaN codes compare by their bits
    assert torch.equal(bits(e4m3_decode(codes, native=True)),
                       bits(codes.view(torch.float8_e4m3fn).float()))
    assert torch.equal(bits(e4m3_decode(codes, native=False)), bits(E4M3.decode(codes)))
    unpacked = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(-1)  # even code: low nibble
    assert torch.equal(bits(e2m1_decode_packed(codes)), bits(E2M1.decode(unpacked)))
    assert e4m3_decode(codes.reshape(16, 16), native=True).shape == (16, 16)


@pytest.mark.parametrize("name", ["fp8", "fp4", "mxfp4", "fp8c"])
def test_grouped_page_decode_equals_decoding_each_buffer(name: str, monkeypatch) -> None:
    """decode_pages decodes runs of same-shaped buffers together: the values are those of one
    decode per buffer, whatever the group size (mixed shapes end a run)."""
    shapes = [(4, 2, 16)] * 3 + [(4, 1, 48)] + [(4, 2, 16)] * 4
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(5, *s, generator=g) * 10.0 ** i for i, s in enumerate(shapes)]
    codec = get_codec(name, page_size=4)
    rows = encode_pages(codec, data)
    each, off = [], 0
    for s in shapes:
        b = codec.encoded_nbytes((math.prod(s),), torch.float32)
        each.append(codec.decode_rows(rows[:, off : off + b].contiguous(), math.prod(s),
                                      torch.float32).reshape(5, *s))
        off += b
    for budget in (1, 5 * 128 * 2, 1 << 30):  # one buffer per call, pairs, whole runs
        monkeypatch.setattr(page_bytes, "DECODE_GROUP_ELEMENTS", budget)
        got = decode_pages(codec, rows, shapes, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, each))
