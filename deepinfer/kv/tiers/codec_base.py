"""The contract of a KV page codec: what the tiers call on every codec, and the checks they share.

A ``Codec`` turns a tensor (one page, or rows of pages) into a fixed number of bytes and back:
``encode_to_tensor`` / ``decode_from_tensor`` (the subclass hooks), the row API the tiers use
(``encode_rows`` / ``decode_rows``), a bytes API, the exact ``encoded_nbytes`` per shape, and a
``tag`` naming interchangeable bytes (cache namespaces). The codecs themselves, their byte
layouts and ``get_codec`` are ``codecs.py``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

__all__ = ["Codec", "Shape"]

Shape = Sequence[int] | torch.Size
Buffer = bytes | bytearray | memoryview


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()


class Codec:
    """Encode a tensor into a fixed-size byte string; ``encoded_nbytes`` is exact per shape."""

    name: str = ""
    block_size: int = 1

    @property
    def tag(self) -> str:
        """Identity for cache namespaces: two codecs with equal tags produce interchangeable bytes."""
        return self.name if self.block_size == 1 else f"{self.name}-b{self.block_size}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tag!r})"

    # -- subclass hooks
    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Encode on x's device into a flat uint8 tensor (lets callers copy into pinned host slots)."""
        raise NotImplementedError

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of ``encode_to_tensor``; computes on buf's device. Lossless returns a view of
        ``buf`` (zero copy): copy it out before ``buf``'s memory (e.g. a host slot) is reused."""
        raise NotImplementedError

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        raise NotImplementedError

    # -- row API: many independent tensors in one call (what the tiers use)
    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Encode each row of ``x`` [n, m] on its own: [n, encoded_nbytes((m,))] uint8 whose row i
        equals ``encode_to_tensor(x[i])`` byte for byte, in a few batched ops instead of n calls."""
        self._check_rows(x)
        return torch.stack([self.encode_to_tensor(r) for r in x]) if len(x) else \
            torch.empty(0, self.encoded_nbytes((x.shape[1],), x.dtype), dtype=torch.uint8, device=x.device)

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of ``encode_rows``: [n, nbytes] uint8 -> [n, m] of ``dtype`` (a new tensor)."""
        out = [self.decode_from_tensor(r.contiguous(), (m,), dtype) for r in buf]
        return torch.stack(out) if out else torch.empty(0, m, dtype=dtype, device=buf.device)

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.dim() != 2:
            raise ValueError(f"{self.name}: encode_rows expects [n, m], got {tuple(x.shape)}")
        self._check_input(x)

    def _check_row_buf(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> int:
        want = self.encoded_nbytes((m,), dtype)
        if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.shape[1] != want:
            raise ValueError(f"{self.name}: expected [n, {want}] uint8 rows for {m} elements, "
                             f"got {tuple(buf.shape)} {buf.dtype}")
        return buf.shape[0]

    # -- bytes API
    def encode(self, x: torch.Tensor) -> bytes:
        return _as_bytes(self.encode_to_tensor(x))

    def decode(
        self, data: Buffer, shape: Shape, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Bytes -> tensor of ``shape``/``dtype`` on ``device`` (one host->device copy)."""
        arr = np.frombuffer(data, dtype=np.uint8)
        buf = torch.from_numpy(arr.copy()).to(device)
        return self.decode_from_tensor(buf, shape, dtype)

    # -- shared checks
    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.shape[-1] % self.block_size != 0:
            raise ValueError(
                f"{self.name}: last dim of shape {tuple(x.shape)} must be a multiple of {self.block_size}"
            )
        if not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating point tensor, got {x.dtype}")

    def _check_buf(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        want = self.encoded_nbytes(shape, dtype)
        if buf.dtype != torch.uint8 or buf.numel() != want:
            raise ValueError(f"{self.name}: expected {want} bytes for {tuple(shape)}, got {buf.numel()}")
        return numel

    def _nblocks(self, shape: Shape) -> int:
        if len(shape) == 0 or shape[-1] % self.block_size != 0:
            raise ValueError(f"{self.name}: last dim of {tuple(shape)} must be a multiple of {self.block_size}")
        return math.prod(shape) // self.block_size

