"""Linear layers whose weights are stored fused (q|k|v, gate|up) but loaded from separate tensors.

Fusing cuts the number of matmul launches per layer, which dominates small-batch decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class NativeLinear:
    """A linear's product as one registered op, ``op(x, *args)`` on rows ``x`` [M, K] with
    M <= ``max_rows``: how code that runs ops without the modules (the native decode stack,
    ``models/llama_native.py``) runs this layer's own kernel."""

    op: str  # "namespace::name" of the op (its default overload)
    args: tuple[torch.Tensor | int | bool | None, ...]
    max_rows: int


class SplitOutputs:
    """A layer whose output concatenates shards of ``out_sizes`` columns (q|k|v, gate|up)."""

    out_sizes: list[int]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)


class WrappedLinear(SplitOutputs, nn.Module):
    """``linear``'s product by another kernel. Keeps the layer's parameters (tied weights stay
    tied, loaders and hooks see them) and ``out_sizes`` (fused layers still split)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_sizes = linear.out_sizes if isinstance(linear, FusedLinear) else [linear.out_features]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model``'s submodule ``name`` is (the load-time kernel swaps)."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, module)


class FusedLinear(SplitOutputs, nn.Linear):
    """One matmul producing several outputs; shard ``i`` occupies rows ``offsets[i]:...``."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        rows = slice(self.offsets[shard], self.offsets[shard] + self.out_sizes[shard])
        getattr(self, name).data[rows].copy_(tensor)
