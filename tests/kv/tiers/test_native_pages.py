"""Native page decode (``native_pages.py``): bit-identical to the torch decode for every lossy
codec, dtype and page layout, written straight into the destination pages and nowhere else."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kv.layout import KVSpec
from deepinfer.kv.pool import PagePool
from deepinfer.kv.tiers.codecs import get_codec
from deepinfer.kv.tiers.minifloat import decode_tables
from deepinfer.kv.tiers.native_pages import decode_into, native_decodes, page_codecs_kernel
from deepinfer.kv.tiers.page_bytes import PoolTransfer, decode_pages, encode_pages, write_decoded

PS = 16
GQA_SHARED_LATENT = [KVSpec.gqa(2, 16), KVSpec.gqa(2, 16, share_with=0), KVSpec((("kv", (1, 48)),)),
                     KVSpec.gqa(1, 32, v_head_dim=16)]
MLA = [KVSpec((("kv", (1, 96)),)) for _ in range(3)]
CODECS = [("fp8", None), ("fp8", 16), ("fp8", 4), ("fp8c", None), ("fp4", None), ("fp4", 32), ("fp4", 4),
          ("mxfp4", None)]  # blocks of 4: the scalar code of an AVX2 build
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not page_codecs_kernel().loaded, reason=page_codecs_kernel().error)


def filled_pool(specs, dtype, seed, num_pages=12):
    """Random pages, with blocks at the dtype's top (rounding up must clamp, not overflow), zero
    blocks (scale 0), tiny ones and ones whose decoded values are float32 subnormals."""
    p = PagePool(specs, num_pages, PS, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for b in p.owned_buffers():
        x = torch.randn(b.shape, generator=g)
        flat = x.view(b.shape[0], -1)
        flat[1, :32] *= 0.0
        flat[2, :64] *= 1e-30
        flat[4, :32] *= 1e-36  # products below float32's normal range: the rounding of subnormals
        flat[3, :32] = torch.finfo(dtype).max * torch.linspace(-1, 1, 32)
        b.copy_(x.to(dtype))
    return p


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,block", CODECS)
@pytest.mark.parametrize("specs", [GQA_SHARED_LATENT, MLA], ids=["gqa-shared-latent", "mla"])
def test_native_decode_is_bit_identical_to_torch(specs, name, block, dtype):
    codec = get_codec(name, block, PS)
    assert native_decodes(codec, dtype)
    src = filled_pool(specs, dtype, 0)
    rows = encode_pages(codec, src.read_pages([1, 2, 3, 4, 5]))
    dest = [9, 2, 7, 0, 4]
    ref, got = filled_pool(specs, dtype, 1), filled_pool(specs, dtype, 1)
    shapes = PoolTransfer(ref).shapes
    ref.write_pages(dest, decode_pages(codec, rows, shapes, dtype))
    decode_into(codec, rows, got.owned_buffers(), dest)
    for r, o in zip(ref.owned_buffers(), got.owned_buffers()):  # the other pages untouched too
        assert torch.equal(bits(r), bits(o))


@pytest.mark.parametrize("name", ["fp8", "fp4"])
def test_write_decoded_of_one_layer_group(name):
    """A layer-wise load decodes one group's buffers at a time: only they change."""
    codec = get_codec(name, None, PS)
    src, ref, got = (filled_pool(GQA_SHARED_LATENT, torch.bfloat16, s) for s in (0, 1, 1))
    rows = encode_pages(codec, [d for d in src.read_pages([1, 2])][2:3])  # the latent buffer
    t_ref, t_got = PoolTransfer(ref), PoolTransfer(got)
    t_ref.write_buffers(range(2, 3), [5, 6], decode_pages(codec, rows, t_ref.shapes[2:3], torch.bfloat16))
    write_decoded(codec, rows, t_got, [5, 6], range(2, 3))
    for r, o in zip(ref.owned_buffers(), got.owned_buffers()):
        assert torch.equal(bits(r), bits(o))


def test_malformed_rows_raise_and_write_nothing():
    codec = get_codec("fp8c", None, PS)
    src, dst = filled_pool(MLA, torch.float32, 0), filled_pool(MLA, torch.float32, 1)
    before = [b.clone() for b in dst.owned_buffers()]
    rows = encode_pages(codec, src.read_pages([1]))
    with pytest.raises(RuntimeError, match="layout needs"):
        decode_into(codec, rows[:, :-1], dst.owned_buffers(), [2])
    with pytest.raises(RuntimeError, match="beyond the pool"):
        decode_into(codec, rows, dst.owned_buffers(), [12])
    for b, a in zip(dst.owned_buffers(), before):
        assert torch.equal(b, a)


def code_region(codec, rows, shapes, dtype):
    """Per buffer of a page row: the byte range of its value codes (fp8: first m bytes; fp4:
    after the 4-byte page scale, m / 2 bytes)."""
    out, off = [], 0
    for s in shapes:
        m = math.prod(s)
        start = off + (4 if codec.name == "fp4" else 0)
        out.append((start, start + (m if codec.name == "fp8" else m // 2)))
        off += codec.encoded_nbytes((m,), dtype)
    assert off == rows.shape[1]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,block", [("fp8", None), ("fp8", 16), ("fp8", 8), ("fp4", None), ("fp4", 32)])
def test_every_code_decodes_as_the_torch_table(name, block, dtype):
    """Random code bytes (all 256 e4m3 codes: subnormals, both zeros, the NaN codes; all 16 e2m1
    codes) through the vector paths and the tails: the torch decode's bits, NaN where it has NaN."""
    codec = get_codec(name, block, PS)
    src = filled_pool(MLA, dtype, 3)
    rows = encode_pages(codec, src.read_pages([1, 2, 3]))
    shapes = PoolTransfer(src).shapes
    g = torch.Generator().manual_seed(5)
    for a, b in code_region(codec, rows, shapes, dtype):
        rows[:, a:b] = torch.randint(0, 256, (rows.shape[0], b - a), generator=g, dtype=torch.uint8)
    ref, got = filled_pool(MLA, dtype, 1), filled_pool(MLA, dtype, 1)
    ref.write_pages([4, 5, 6], decode_pages(codec, rows, shapes, dtype))
    decode_into(codec, rows, got.owned_buffers(), [4, 5, 6])
    for r, o in zip(ref.owned_buffers(), got.owned_buffers()):
        nan = r.isnan()
        assert torch.equal(nan, o.isnan())
        assert torch.equal(bits(r)[~nan], bits(o)[~nan])


def around(x):
    """float32 x, its neighbours and x / 2, 2x."""
    t = torch.tensor([x], dtype=torch.float32)
    return [x / 2, torch.nextafter(t, torch.zeros(1)).item(), t.item(),
            torch.nextafter(t, torch.full((1,), math.inf)).item(), 2 * x]


@pytest.mark.parametrize("name", ["fp8", "fp4"])
def test_bfloat16_decode_at_the_edges_of_its_fast_path(name):
    """Block scales either side of where a bfloat16 decode rounds a vector in one instruction
    (every product zero or normal and within bfloat16's range; e4m3 from the code bits up to a
    scale of 2**7), whole rows of one scale and rows of mixed ones: the torch decode's bits."""
    codec = get_codec(name, None, PS)
    dtype = torch.bfloat16
    lowest, highest = (2.0**-9, 448.0) if name == "fp8" else (0.5, 6.0)  # the codes' values
    edges = [e for x in (2.0**-126 / lowest, torch.finfo(dtype).max / highest, 2.0**7) for e in around(x)]
    src = filled_pool(MLA, dtype, 3)
    rows = encode_pages(codec, src.read_pages([1] * (len(edges) + 1)))
    shapes = PoolTransfer(src).shapes
    g = torch.Generator().manual_seed(7)
    for j, (a, b) in enumerate(code_region(codec, rows, shapes, dtype)):
        codes = torch.randint(0, 256, (rows.shape[0], b - a), generator=g, dtype=torch.uint8)
        if name == "fp8":
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN code: a row with one takes the exact path throughout
        rows[:, a:b] = codes
        sign = -1.0 if j % 2 else 1.0
        nb = math.prod(shapes[j]) // codec.block_size
        for r in range(rows.shape[0]):
            each = [edges[(r + k) % len(edges)] for k in range(nb)] if r == len(edges) else [edges[r]] * nb
            if name == "fp8":  # float32 block scales after the codes
                rows[r, b : b + 4 * nb] = torch.tensor(each, dtype=torch.float32).mul(sign).view(torch.uint8)
            else:  # the page scale before the codes, and e4m3 1.0 for every block
                rows[r, a - 4 : a] = torch.tensor([each[0] * sign], dtype=torch.float32).view(torch.uint8)
                rows[r, b : b + nb] = 0x38
    pages = list(range(1, rows.shape[0] + 1))
    ref, got = filled_pool(MLA, dtype, 1, len(pages) + 1), filled_pool(MLA, dtype, 1, len(pages) + 1)
    ref.write_pages(pages, decode_pages(codec, rows, shapes, dtype))
    decode_into(codec, rows, got.owned_buffers(), pages)
    for r, o in zip(ref.owned_buffers(), got.owned_buffers()):
        assert torch.equal(bits(r), bits(o))


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="no FTZ/DAZ control on this CPU")
def test_fp8_decode_with_subnormal_inputs_flushed():
    """Under DAZ (``torch.set_flush_denormal``) the decode does not build values from float32
    subnormals (the e4m3 subnormal codes): the same bits as the torch decode under it."""
    codec = get_codec("fp8", None, PS)
    src = filled_pool(MLA, torch.bfloat16, 3)
    rows = encode_pages(codec, src.read_pages([1, 2, 3]))
    shapes = PoolTransfer(src).shapes
    g = torch.Generator().manual_seed(6)
    for a, b in code_region(codec, rows, shapes, torch.bfloat16):
        rows[:, a:b] = torch.randint(0, 8, (rows.shape[0], b - a), generator=g, dtype=torch.uint8)  # subnormals, 0
    ref, got = filled_pool(MLA, torch.bfloat16, 1), filled_pool(MLA, torch.bfloat16, 1)
    torch.set_flush_denormal(True)
    try:
        ref.write_pages([4, 5, 6], decode_pages(codec, rows, shapes, torch.bfloat16))
        decode_into(codec, rows, got.owned_buffers(), [4, 5, 6])
    finally:
        torch.set_flush_denormal(False)
    for r, o in zip(ref.owned_buffers(), got.owned_buffers()):
        assert torch.equal(bits(r), bits(o))
        assert (r[4:7] != 0).any()  # the subnormal codes decoded to values, not flushed


def test_fp8_decode_with_another_table_gathers_from_it():
    """A table that is not e4m3fn's own values (the op's gather path): table[code] * scale."""
    codec = get_codec("fp8", None, PS)
    src, got = filled_pool(MLA, torch.float32, 0), filled_pool(MLA, torch.float32, 1)
    rows = encode_pages(codec, src.read_pages([1]))
    e4m3, e2m1 = decode_tables(codec.native)
    table = e4m3 * 1.5
    torch.ops.deepinfer_kv_codecs.decode_into(rows, torch.tensor([7]), got.owned_buffers(), 0,
                                              codec.block_size, 0, table, e2m1)
    m = math.prod(PoolTransfer(src).shapes[0])
    for j, o in enumerate(got.owned_buffers()):
        row = rows[0, j * (m + m // codec.block_size * 4):]
        codes = row[:m].long()
        scales = row[m : m + m // codec.block_size * 4].clone().view(torch.float32)
        want = (table[codes].view(-1, codec.block_size) * scales[:, None]).reshape(o[7].shape)
        assert torch.equal(o[7], want)
