"""Lossy page bytes decoded natively straight into a CPU pool, and CPU pages encoded natively
(``csrc/page_codecs.cpp``).

The torch decode of an FP8 / FP4 page is a dozen ops over temporaries (gathers, scale
products, clamps, casts) and then a copy into the pool; at one page per call their dispatch and
memory traffic, not the arithmetic, bound a load. The native op computes the same values from
the same tables (``minifloat.decode_tables``) and writes them once, into the destination pages,
on the caller's thread (the loader's reader threads decode their own pages in parallel; it
releases the GIL). ``native_decodes`` is the one check of where it runs:
a codec it knows, a CPU pool of float32 / bfloat16 / float16, and the library built (it is not
with ``DEEPINFER_NO_NATIVE_KERNELS=1``: ``decode_pages`` then does the work).

The torch encode costs the tier writers most of their time (FP4's table rounding above all);
``encode_native`` gives the same bytes from one pass over each page, where ``native_encodes``:
fp8 / fp4 with torch's float8 conversion (the one the op repeats) and mxfp4. ``fp8c`` stays on
the torch encode: its token choice sums in torch's reduction order, which depends on its ISA.
"""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path

import torch

from ...native_build import NativeExtension, build_extension
from .codec_base import Codec
from .codecs import FP4Codec, FP8CenteredCodec, FP8Codec, MXFP4Codec
from .minifloat import HAS_NATIVE_FP8, decode_tables

SOURCE = Path(__file__).parent / "csrc" / "page_codecs.cpp"
STEM = "deepinfer_kv_codecs"
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODEC_IDS: dict[type[Codec], int] = {FP8Codec: 0, FP8CenteredCodec: 1, FP4Codec: 2, MXFP4Codec: 3}
_ENCODES = (FP8Codec, FP4Codec, MXFP4Codec)
_build_lock = threading.Lock()  # loader threads may ask first at once; the library loads once


@cache
def _build() -> NativeExtension:
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_kv_codecs.isa())


def page_codecs_kernel() -> NativeExtension:
    """Build (once per machine) and load the op; never raises."""
    with _build_lock:
        return _build()


def native_decodes(codec: Codec, dtype: torch.dtype) -> bool:
    """Whether ``decode_into`` decodes ``codec``'s pages into a CPU pool of ``dtype``."""
    return type(codec) in _CODEC_IDS and dtype in NATIVE_DTYPES and page_codecs_kernel().loaded


def _params(codec: Codec) -> tuple[int, int, bool]:
    """(block size, tokens per row or 0, which e4m3 table the torch decode gathers from)."""
    if isinstance(codec, FP8CenteredCodec):
        return codec.block_size, codec.tokens, codec.fp8.native
    if isinstance(codec, (FP8Codec, FP4Codec)):
        return codec.block_size, 0, codec.native
    return codec.block_size, 0, HAS_NATIVE_FP8  # mxfp4 reads no e4m3 code


def decode_into(codec: Codec, rows: torch.Tensor, buffers: list[torch.Tensor], pages: list[int]) -> None:
    """Page rows [n, page_nbytes] uint8 (the layout of ``page_bytes.encode_pages`` over
    ``buffers``) -> the values of page ``pages[i]`` in every buffer [num_pages, ...], in place;
    bit-identical to ``decode_pages`` then ``write_pages``. Raises on a malformed row, or where
    the op did not build (``native_decodes`` says whether it did)."""
    kernel = page_codecs_kernel()
    if not kernel.loaded:
        raise RuntimeError(kernel.error)
    block, tokens, native = _params(codec)
    e4m3, e2m1 = decode_tables(native)
    torch.ops.deepinfer_kv_codecs.decode_into(rows.contiguous(), torch.tensor(pages, dtype=torch.int64),
                                              buffers, _CODEC_IDS[type(codec)], block, tokens, e4m3, e2m1)


def native_encodes(codec: Codec, dtype: torch.dtype) -> bool:
    """Whether ``encode_native`` encodes CPU pages of ``dtype`` with ``codec``."""
    torch_fp8 = not isinstance(codec, (FP8Codec, FP4Codec)) or codec.native
    return (type(codec) in _ENCODES and torch_fp8 and dtype in NATIVE_DTYPES
            and page_codecs_kernel().loaded)


def encode_native(codec: Codec, data: list[torch.Tensor]) -> torch.Tensor:
    """Per-buffer CPU page tensors [n, *page_shape] -> [n, page_nbytes] uint8, byte for byte
    ``page_bytes.encode_pages``' torch result (ValueError on a NaN / Inf page, as there)."""
    kernel = page_codecs_kernel()
    if not kernel.loaded:
        raise RuntimeError(kernel.error)
    e4m3, _ = decode_tables(True)
    return torch.ops.deepinfer_kv_codecs.encode_pages([d.contiguous() for d in data], _CODEC_IDS[type(codec)],
                                                      codec.block_size, e4m3)
