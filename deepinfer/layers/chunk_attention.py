"""Attention of a prefill chunk that continues a sequence: earlier keys, then its own, no mask.

A chunk after the first (a chunked prefill, or a tail after a prefix-cache hit) attends to every
earlier key and causally to its own. One SDPA call over all keys needs an explicit
``[q_len, kv_len]`` mask (``is_causal`` aligns the diagonal top-left, not bottom-right), and
with a mask the CPU flash kernel reads the mask for every block and cannot run its unmasked
inner loop. Instead: two unmasked calls, earlier keys in full and the chunk's own keys with
``is_causal`` (square, so its diagonal is right), merged by their log-sum-exps: the
online-softmax step the flash kernel applies between its own key blocks. The CPU flash op
returns that log-sum-exp; other devices keep the masked call (this path is untested there), and
so do windows, ring views, softcap and sinks (not every earlier key is visible, or the softmax
is not plain).
"""

from __future__ import annotations

import torch

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def splits_at_prefix(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``prefix_then_causal`` runs these tensors: on the CPU, with values as wide as the
    queries (the flash kernel's contract; MLA's narrower values keep the masked call)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                       scale: float) -> torch.Tensor:
    """q [1, Hq, Lq, D]; k/v [1, Hkv, prefix + Lq, D], the chunk's own keys last. Query i sees
    keys ``0 .. prefix + i``. Returns [1, Hq, Lq, D] (GQA: Hq a multiple of Hkv)."""
    o_pre, lse_pre = _flash_with_lse(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
    return then_causal(q, o_pre, lse_pre, k[:, :, prefix:], v[:, :, prefix:], scale)


def then_causal(q: torch.Tensor, o_pre: torch.Tensor, lse_pre: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float) -> torch.Tensor:
    """The chunk's own keys k_own/v_own [1, Hkv, Lq, D] causally, merged with its attention over
    the earlier keys, o_pre [1, Hq, Lq, D] with its log-sum-exp lse_pre [1, Hq, Lq] (computed by
    the flash op above, or by torch over gathered pages). Returns [1, Hq, Lq, D]."""
    o_own, lse_own = _flash_with_lse(q, k_own, v_own, is_causal=True, scale=scale)
    # softmax weight of the earlier keys' block: e^lse_pre / (e^lse_pre + e^lse_own)
    w_pre = torch.sigmoid(lse_pre - lse_own).unsqueeze(-1)
    return torch.lerp(o_own.float(), o_pre.float(), w_pre).to(q.dtype)
