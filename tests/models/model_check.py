"""Compare our model classes with transformers' on tiny random-weight models.

Our side runs through ``ModelRunner`` with a duck-typed checkpoint (config + ``weights()`` from the
HF model's state dict), so loading, the pool layout and the paged attention path are all exercised.
"""

from __future__ import annotations

import types

import torch

from deepinfer.config import EngineConfig
from deepinfer.model_runner import ModelRunner
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams


def make_runner(hf_model, page_size: int = 4, num_pages: int = 128, max_len: int = 256,
                state_dict: dict | None = None, ckpt=None) -> ModelRunner:
    """A float32 runner (on the test device) over ``ckpt``, by default the HF model's (or the given) state dict."""
    if ckpt is None:
        sd = state_dict if state_dict is not None else hf_model.state_dict()
        ckpt = types.SimpleNamespace(config=hf_model.config, weights=lambda: iter(sd.items()),
                                     name=type(hf_model).__name__, fingerprint="test")
    # window_chunk_tokens: these tests prefill in chunks of any size (the engine caps them)
    return ModelRunner(EngineConfig(page_size=page_size, num_pages=num_pages, dtype="float32",
                                    progress=False, window_chunk_tokens=max_len),
                       ckpt, max_len)


def new_request(runner: ModelRunner, ids: list[int], rid: str = "r", reserve: int = 16) -> Request:
    req = Request(rid, list(ids), SamplingParams())
    n_pages = -(-(len(ids) + reserve) // runner.page_size)
    req.pages = runner.pool.allocator.alloc(n_pages)
    assert req.pages is not None, "test pool too small"
    return req


def prefill(runner: ModelRunner, req: Request, chunk_sizes: list[int] | None) -> torch.Tensor:
    """Logits [len(prompt), V] of the prompt, computed in the given chunks (None = one chunk)."""
    n = req.num_tokens - req.num_computed_tokens
    chunks = list(chunk_sizes or [n])
    assert sum(chunks) == n, (chunks, n)
    out = []
    for c in chunks:
        out.append(runner.prompt_logits([(req, c)]).cpu())
        req.num_computed_tokens += c
    return torch.cat(out)


def run_prompt_logits(runner: ModelRunner, ids: list[int], chunk_sizes: list[int] | None = None,
                      rid: str = "r") -> torch.Tensor:
    req = new_request(runner, ids, rid)
    return prefill(runner, req, chunk_sizes)


def decode_steps(runner: ModelRunner, reqs: list[Request], last_logits: list[torch.Tensor],
                 steps: int) -> list[list[torch.Tensor]]:
    """Greedy-decode all requests together (one batched decode per step); logits per step."""
    out: list[list[torch.Tensor]] = [[] for _ in reqs]
    cur = list(last_logits)
    for _ in range(steps):
        for r, lg in zip(reqs, cur):
            r.output_token_ids.append(int(lg.argmax()))
        logits = runner.prompt_logits([(r, 1) for r in reqs]).cpu()
        for i, r in enumerate(reqs):
            r.num_computed_tokens += 1
            out[i].append(logits[i])
        cur = list(logits)
    return out


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def check_against_hf(hf_model, ids: list[int], chunk_sizes: list[int], other_ids: list[int],
                     decode: int = 4, page_size: int = 4) -> dict[str, float]:
    """Max abs logit diffs vs transformers for (a) one-shot prefill, (b) chunked prefill over pages,
    (c) batched greedy decoding of two sequences of different lengths."""
    diffs: dict[str, float] = {}
    ref = hf_logits(hf_model, ids)

    runner = make_runner(hf_model, page_size=page_size)
    diffs["prefill"] = (run_prompt_logits(runner, ids, None) - ref).abs().max().item()

    runner = make_runner(hf_model, page_size=page_size)
    a = new_request(runner, ids, "a", reserve=decode + 1)
    la = prefill(runner, a, chunk_sizes)
    diffs["chunked"] = (la - ref).abs().max().item()

    b = new_request(runner, other_ids, "b", reserve=decode + 1)
    lb = prefill(runner, b, None)
    diffs["prefill_b"] = (lb - hf_logits(hf_model, other_ids)).abs().max().item()
    steps = decode_steps(runner, [a, b], [la[-1], lb[-1]], decode)
    worst = 0.0
    for req, got in zip((a, b), steps):
        full = hf_logits(hf_model, req.all_token_ids)
        n_prompt = req.num_prompt_tokens
        for i, lg in enumerate(got):
            worst = max(worst, (lg - full[n_prompt + i]).abs().max().item())
    diffs["decode"] = worst
    return diffs


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def randomize_(model, seed: int = 0) -> None:
    """Re-draw every weight at unit gain (std fan_in^-0.5; embeddings std 1; vectors: their init
    value + N(0, 0.1)) so activations and logits are O(1) and a wrong formula shows clearly."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
            continue
        if t.dim() >= 2:
            std = 1.0 if "embed_tokens" in name else t.shape[-1] ** -0.5
            t.copy_(torch.randn(t.shape, generator=g) * std)
        elif t.dim() == 1:
            t.add_(torch.randn(t.shape, generator=g) * 0.1)
