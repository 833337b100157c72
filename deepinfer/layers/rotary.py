"""Rotary position embeddings with a precomputed cos/sin table indexed by absolute position.

Positions come from the batch (not from sequence order), which is what lets a prefill chunk
start in the middle of a sequence whose prefix came from the cache. Float32 or bf16 on the CPU,
NeoX halves over the whole head run our native op (``native_ops.py``: one call instead of about
ten, the same bits); the other cases, torch's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .native_ops import small_ops_apply


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (on the CPU) and the attention scaling for the config's RoPE type."""
    params = config.rope_parameters
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        exps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        return 1.0 / base**exps, 1.0
    # Scaled variants (llama3, yarn, linear, ...): reuse transformers' reference formulas.
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    # The runner builds models under ``torch.device("meta")``; these formulas create tensors
    # without a device, so pin them to the CPU (the tables are computed, never loaded).
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), scaling


class RotaryEmbedding(nn.Module):
    """cos/sin tables are plain attributes, not buffers: computed (never loaded) and kept fp32."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0,
                 interleaved: bool = False, tail: bool = False) -> None:
        super().__init__()
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.max_positions = max_positions
        self.scaling = scaling
        self.rot_dim = 2 * inv_freq.numel()
        # interleaved: pairs are (x0, x1), (x2, x3)... (GPT-J / DeepSeek); else halves (NeoX / HF).
        self.interleaved = interleaved
        # tail: rotate the *last* rot_dim dims (DeepSeek-V4's [nope | rope] heads), else the first.
        self.tail = tail
        self._last_positions: torch.Tensor | None = None
        self._last_tables: tuple[torch.Tensor, torch.Tensor] = ()
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        # fp32 arithmetic, as the reference implementations do, so positions agree bit for bit
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)
        self.cos = (freqs.cos() * self.scaling).float().to(device)
        self.sin = (freqs.sin() * self.scaling).float().to(device)
        self._last_positions = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate ``x`` of shape [T, heads, head_dim] (``rot_dim`` of its dims) by position;
        ``inverse`` rotates by minus the position (undoes the rotation)."""
        if not inverse and self.native(positions, x):
            return torch.ops.deepinfer_ops.rotate(x, self.cos, self.sin, positions.contiguous())
        cos, sin = self._tables(positions)
        if inverse:
            sin = -sin
        full = x.shape[-1] == self.rot_dim
        split = x.shape[-1] - self.rot_dim if self.tail else self.rot_dim
        rot = x if full else (x[..., split:] if self.tail else x[..., :split])
        if rot.dtype != torch.float32:
            rot = rot.float()
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = out.to(x.dtype)
        if full:
            return out
        return torch.cat((x[..., :split], out) if self.tail else (out, x[..., split:]), dim=-1)

    def native(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether our native op rotates ``x`` [T, heads, head_dim] (NeoX halves over whole heads)."""
        return (not self.interleaved and x.dim() == 3 and x.shape[2] == self.rot_dim and x.stride(2) == 1
                and positions.dtype == torch.long and positions.dim() == 1 and small_ops_apply(x)
                and self.cos.is_cpu)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: look the tables up once.
        if positions is not self._last_positions:
            self._last_positions = positions
            self._last_tables = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._last_tables
