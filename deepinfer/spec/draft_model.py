"""Draft source ``draft_model``: a small model sharing the target's tokenizer, run by our own
model runner on its own small paged KV pool.

Each target request gets a shadow sequence in the draft pool whose KV holds a prefix of the
request's tokens. Before drafting, the shadow rolls back to the longest prefix the request
still agrees with (so the KV of draft tokens the target rejected is dropped with the
target's), catches up on the tokens it has not seen in one chunk, then decodes up to k
tokens: greedily for greedy requests, else drawn from the draft distribution q under the
request's own temperature / top-k / top-p / min-p, which the rejection sampling in
``verify.py`` needs. Shadows do not share prefixes (no radix tree): each computes its
request's context once and then extends it incrementally. Feature per position: the draft's
probability of its token, in tenths.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import EngineConfig
from ..layers.sampler import filtered_probs
from ..loader import Checkpoint, load_checkpoint
from ..model_runner import ModelRunner
from ..request import Request
from .config import SpeculativeConfig
from .drafters import Draft

PROB_BINS = 10


class DraftModel:
    name = "draft_model"

    def __init__(self, runner: ModelRunner, target: ModelRunner) -> None:
        self.runner = runner
        self.target = target  # owns the requests' random generators
        self.allocator = runner.pool.allocator
        self.page_size = runner.page_size
        self.shadows: dict[Request, Request] = {}  # target request -> its sequence in the draft pool
        self.committed: dict[Request, int] = {}  # leading shadow tokens known to be the request's

    # ------------------------------------------------------------------ shadows
    def _free(self, req: Request) -> None:
        shadow = self.shadows.pop(req)
        self.committed.pop(req)
        self.allocator.free(shadow.pages)

    def finished(self, req: Request) -> None:
        if req in self.shadows:
            self._free(req)

    def _sync(self, req: Request, k: int, keep: set[Request]) -> Request | None:
        """The request's shadow holding its tokens, rolled back to the prefix it still agrees
        with, with pages for ``k - 1`` draft tokens more; None when the pool is full even after
        dropping the shadows of requests outside this step (``keep``)."""
        tokens = req.all_token_ids
        shadow = self.shadows.get(req)
        if shadow is None:
            shadow = self.shadows[req] = Request(req.request_id, [], req.params)
            self.committed[req] = 0
        # at least the last token is fed again: its logits give the first draft token
        end = min(shadow.num_computed_tokens, len(tokens) - 1)
        n, seen = min(self.committed[req], end), shadow.all_token_ids
        while n < end and seen[n] == tokens[n]:
            n += 1
        shadow.num_computed_tokens = n
        shadow.prompt_token_ids, shadow.output_token_ids = tokens, []
        need = -(-(len(tokens) + k - 1) // self.page_size) - len(shadow.pages)
        if need > self.allocator.num_free:
            for other in [r for r in self.shadows if r not in keep]:
                self._free(other)
        pages = self.allocator.alloc(max(need, 0))
        if pages is None:
            return None
        shadow.pages += pages
        self.committed[req] = len(tokens)
        return shadow

    # ------------------------------------------------------------------ drafting
    def propose_batch(self, items: list[tuple[Request, int]]) -> list[Draft]:
        for req in [r for r in self.shadows if r.is_finished]:  # aborted, failed: never observed
            self._free(req)
        keep = {req for req, _ in items}
        drafts = [Draft(self.name) for _ in items]
        q_rows: list[list[torch.Tensor]] = [[] for _ in items]
        live: list[tuple[int, Request, Request, int]] = []  # (item index, request, shadow, k)
        for i, (req, k) in enumerate(items):
            shadow = self._sync(req, k, keep) if k > 0 else None
            if shadow is not None:
                live.append((i, req, shadow, k))
        run = [(s, s.num_tokens - s.num_computed_tokens) for _, _, s, _ in live]
        while live:
            sampled, logits = self.runner.forward(run)
            for s, n in run:
                s.num_computed_tokens += n
            assert logits is not None
            row = {s: j for j, s in enumerate(sampled)}  # the runner puts decodes first
            order = torch.tensor([row[s] for _, _, s, _ in live], device=logits.device)
            tokens = self._pick(live, logits[order].float(), drafts, q_rows)
            for (_, _, s, _), tok in zip(live, tokens):
                s.output_token_ids.append(tok)
            live = [x for x in live if len(drafts[x[0]].tokens) < x[3]]
            run = [(s, 1) for _, _, s, _ in live]
        for d, rows in zip(drafts, q_rows):
            d.probs = torch.stack(rows) if rows else None
        return drafts

    def _pick(self, live: list[tuple[int, Request, Request, int]], logits: torch.Tensor,
              drafts: list[Draft], q_rows: list[list[torch.Tensor]]) -> list[int]:
        """Each live request's next draft token from its logits row (argmax for greedy
        requests, else a draw from q), recorded with its feature (and q row)."""
        out = []
        for row, (i, req, _, _) in zip(logits, live):
            if req.params.greedy:
                probs = row.softmax(-1)
                tok = int(row.argmax())
            else:
                probs = filtered_probs(row[None], [req.params])[0]
                tok = int(torch.multinomial(probs, 1, generator=self.target.request_generator(req)))
                q_rows[i].append(probs)
            drafts[i].tokens.append(tok)
            drafts[i].features.append(min(int(float(probs[tok]) * PROB_BINS), PROB_BINS - 1))
            out.append(tok)
        return out


def build_draft_model(sc: SpeculativeConfig, config: EngineConfig, target_ckpt: Checkpoint,
                      target: ModelRunner, max_model_len: int) -> DraftModel:
    """Load the draft checkpoint and its runner; a clear error when it cannot draft for the
    target (another tokenizer or vocabulary, a shorter context)."""
    assert sc.model is not None
    ckpt = load_checkpoint(sc.model, progress=config.progress)
    check_compatible(ckpt, target_ckpt, max_model_len)
    draft_config = dataclasses.replace(
        config, model=sc.model, window_ring=False, speculative_config=None,
        num_pages=sc.draft_num_pages or target.pool.allocator.num_pages,
        quantization=sc.draft_quantization or config.quantization)
    return DraftModel(ModelRunner(draft_config, ckpt, max_model_len), target)


def check_compatible(draft: Checkpoint, target: Checkpoint, max_model_len: int) -> None:
    name = f"draft model {draft.name!r}"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{name} has a vocabulary of {draft.config.vocab_size} tokens, the target "
                         f"{target.name!r} of {target.config.vocab_size}: they must be the same")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"{name} does not share the tokenizer of the target {target.name!r} "
                         "(different token ids)")
    limit = getattr(draft.config, "max_position_embeddings", max_model_len)
    if limit < max_model_len:
        raise ValueError(f"{name} handles {limit} positions, less than max_model_len={max_model_len}")
