"""Turns a scheduled batch into tensors, runs the model over the paged pool, samples.

The runner owns the device state (weights and KV pool); everything above it deals in token
ids and page ids only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from .config import EngineConfig
from .forward_batch import ForwardBatch, PrefillSegment, Workspace
from .kv.build import build_device_kv
from .layers.batch_rows_linear import use_batch_rows_linears
from .layers.logits_processors import apply_logit_bias, apply_penalties
from .layers.rotary import RotaryEmbedding
from .layers.sampler import SampleResult, sample
from .layers.prepacked_linear import use_prepacked_linears
from .layers.small_row_linear import use_small_row_linears
from .loader.quantized import dequantized
from .models.llama_native import build_decode_stack
from .models.registry import model_class
from .quant.kernels import plan_quantization
from .quant.gguf_blocks import gguf_weights, linear_weights
from .quant.linear import quantize_model
from .quant.weights import QuantizedWeight
from .request import Request

if TYPE_CHECKING:
    from .loader import Checkpoint


@dataclass
class PreparedStep:
    """A step's tensors and who samples; ``pending`` are inputs (index into ``input_ids``,
    request) whose token the step before samples (overlap scheduling), set before the forward."""

    batch: ForwardBatch
    sampled: list[Request]
    pending: list[tuple[int, Request]]


class ModelRunner:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint, max_model_len: int) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.quant_plan = plan_quantization(config.quantization, config.quantization_kernel,
                                            self.device, self.dtype)
        self.model = self._build_model(ckpt, max_model_len)
        self.specs = self.model.kv_specs()
        self.page_size = config.page_size
        self.device_kv = build_device_kv(config, self.specs, max_model_len, self.dtype, self.device)
        self.pool = self.device_kv.pool
        self.window = self.device_kv.window  # sliding-window rings (kv/window/), if any
        self.window_layout = self.window.layout if self.window is not None else None
        self.kv_buffers = self.device_kv.layer_buffers(len(self.specs))
        # steps of decodes and short spans in one native call where the model allows (models/llama_native.py)
        self.decode_stack = None if config.enforce_eager else build_decode_stack(self.model, self.dtype,
                                                                                 self.kv_buffers)
        self.workspace = Workspace()  # gathered decode K/V, shared by every layer and step

    def _build_model(self, ckpt: Checkpoint, max_model_len: int):
        # Quantized tensors are de-quantized on the device, straight into the model dtype; an
        # unsupported quantization raises here, before any memory is allocated.
        weights = dequantized(ckpt.config, ((n, t.to(self.device)) for n, t in ckpt.weights()),
                              self.dtype)
        cls = model_class(ckpt.config)
        with torch.device("meta"):  # no random init: every weight comes from the checkpoint
            model = cls(ckpt.config, max_model_len).cast(self.dtype)
        model = model.to_empty(device=self.device)
        for m in model.modules():  # tables that are computed, not loaded
            if isinstance(m, RotaryEmbedding):
                m.build(self.device)
        if self.config.progress:
            weights = tqdm(weights, desc=f"loading {ckpt.name}", unit=" tensors", leave=False)
        model.load_weights(weights)  # copies cast each tensor into its parameter's dtype
        quantize_model(model, self.quant_plan, skip=model.unquantized_linears + model.fp32_params,
                       prequantized=self._checkpoint_blocks(ckpt, model))
        use_batch_rows_linears(model)  # bf16 without AMX: one packed kernel for every row count
        use_small_row_linears(model)  # the float linears left: the native kernel for a few rows
        use_prepacked_linears(model)  # ... and oneDNN on a packed weight for more rows
        return model.eval()

    def _checkpoint_blocks(self, ckpt: Checkpoint, model) -> dict[str, QuantizedWeight]:
        """A GGUF's own quantized blocks for the linear layers (fbgemm wants per-channel int8,
        which they are not: it re-quantizes)."""
        plan = self.quant_plan
        if plan.scheme == "none" or plan.kernel == "fbgemm" or ckpt.gguf is None:
            return {}
        bits = 8 if plan.scheme == "int8" else 4
        return linear_weights(model, gguf_weights(ckpt.path, ckpt.gguf, bits))

    # ------------------------------------------------------------------ batch
    def prepare(self, items: list[tuple[Request, int]]) -> PreparedStep:
        """Flatten a step: one-token items form the batched decode group, then prefill chunks."""
        ps = self.page_size
        decodes = [(r, n) for r, n in items if n == 1]
        prefills = [(r, n) for r, n in items if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Request] = []
        logit_idx: list[int] = []
        pending: list[tuple[int, Request]] = []
        for r, _ in decodes:
            pos = r.num_computed_tokens
            if pos < r.num_tokens:
                ids.append(r.token_at(pos))
            else:  # sampled by the step in flight: a placeholder until the forward
                pending.append((len(ids), r))
                ids.append(0)
            positions.append(pos)
            slots.append(r.pages[pos // ps] * ps + pos % ps)
        decode_pages = decode_lens = None
        if decodes:
            width = max(len(r.pages) for r, _ in decodes)
            decode_pages = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r, _ in decodes])
            decode_lens = torch.tensor([r.num_computed_tokens + 1 for r, _ in decodes])
        segments: list[PrefillSegment] = []
        for r, n in prefills:
            start = r.num_computed_tokens
            ids += r.all_token_ids[start : start + n]
            pos = torch.arange(start, start + n)
            page_t = torch.tensor(r.pages[: -(-(start + n) // ps)])
            positions += pos.tolist()
            slots += (page_t[pos // ps] * ps + pos % ps).tolist()
            segments.append(PrefillSegment(q_start=len(ids) - n, q_len=n, kv_len=start + n,
                                           pages=page_t.to(self.device)))
        q_end = 0
        for r, n in decodes + prefills:
            q_end += n
            if r.num_computed_tokens + n == r.num_scheduled_tokens and not r.params.prefill_only:
                logit_idx.append(q_end - 1)
                sampled.append(r)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            page_size=ps,
            num_decodes=len(decodes),
            decode_pages=None if decode_pages is None else decode_pages.to(dev),
            decode_kv_lens=None if decode_lens is None else decode_lens.to(dev),
            prefills=segments,
            logits_indices=torch.tensor(logit_idx, device=dev, dtype=torch.long),
            layer_loads=tuple(r.kv_load.layers for r, _ in items  # (a 1-token tail is a "decode")
                              if r.kv_load is not None and r.kv_load.layers is not None),
            workspace=self.workspace,
            attention_backend=self.config.attention_backend,
        )
        if self.window is not None:
            self.window.attach(batch, decodes, prefills, self.device_kv.window_chunk_tokens)
        return PreparedStep(batch, sampled, pending)

    @torch.inference_mode()
    def forward(self, items: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        """Run one step; returns the requests that produce a token and their logits rows."""
        step = self.prepare(items)
        return step.sampled, self.logits(step)

    @torch.inference_mode()
    def logits(self, step: PreparedStep, tokens: dict[Request, int] | None = None) -> torch.Tensor | None:
        """Forward a prepared step; ``tokens`` holds its pending inputs' values. The logits rows
        of the sampled requests (None when none samples)."""
        batch = step.batch
        if step.pending:
            assert tokens is not None, "a step with pending inputs needs the step before's tokens"
            at = torch.tensor([i for i, _ in step.pending], device=self.device)
            # (a request missing from ``tokens`` failed in the step before: its row is dropped)
            batch.input_ids[at] = torch.tensor([tokens.get(r, 0) for _, r in step.pending],
                                               device=self.device)
        hidden = self.hidden(batch)
        if not step.sampled:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices])

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's hidden states [T, hidden] of the step's new tokens (their KV written)."""
        if self.decode_stack is not None and self.decode_stack.runs(batch):
            return self.decode_stack.forward(batch)
        return self.model(batch, self.kv_buffers)

    @torch.inference_mode()
    def forward_spans(self, items: list[tuple[Request, int]],
                      spans: dict[Request, int]) -> tuple[list[Request], list[torch.Tensor]]:
        """Like ``forward``, with the logits of the last ``spans[r]`` new tokens of each request
        r there (one row for the others): speculative verify spans (``spec/``)."""
        step = self.prepare(items)
        batch, sampled = step.batch, step.sampled
        hidden = self.hidden(batch)
        if not sampled:
            return sampled, []
        sizes = [spans.get(r, 1) for r in sampled]
        rows = torch.cat([torch.arange(i - n + 1, i + 1)  # a sequence's new tokens are contiguous
                          for i, n in zip(batch.logits_indices.tolist(), sizes)])
        logits = self.model.compute_logits(hidden[rows.to(self.device)])
        return sampled, list(logits.split(sizes))

    @torch.inference_mode()
    def sample(self, reqs: list[Request], logits: torch.Tensor
               ) -> tuple[list[Request], SampleResult | None, list[tuple[Request, Exception]]]:
        """One token per row. Returns the requests that got one, their samples, and the
        requests whose sampling raised: then the rows are sampled one at a time (generators
        rewound first), so the others draw what they would have drawn anyway."""
        gens: list[torch.Generator] = []  # state of every generator this step draws from
        for r in reqs:
            try:
                g = self.request_generator(r)
            except Exception:  # noqa: BLE001 - a bad seed: its row fails again below, alone
                continue
            if g is not None and all(g is not x for x in gens):
                gens.append(g)
        states = [g.get_state() for g in gens]
        try:
            return reqs, self._sample_rows(reqs, logits), []
        except Exception as e:  # noqa: BLE001 - one request's parameters: find it row by row
            if len(reqs) == 1:  # never raised: a caller has other requests' state to keep
                return [], None, [(reqs[0], e)]
        for g, st in zip(gens, states):
            g.set_state(st)
        ok: list[Request] = []
        rows: list[SampleResult] = []
        failed: list[tuple[Request, Exception]] = []
        for i, r in enumerate(reqs):
            try:
                rows.append(self._sample_rows([r], logits[i : i + 1]))
                ok.append(r)
            except Exception as e:  # noqa: BLE001
                failed.append((r, e))
        return ok, SampleResult.concat(rows), failed

    def _sample_rows(self, reqs: list[Request], logits: torch.Tensor) -> SampleResult:
        """Logit bias, penalties and grammar masks (only on the rows that ask for them, on a
        copy: ``logits`` stays as it was), then the sampler."""
        edited = any(r.params.logit_bias or r.params.penalized or r.grammar is not None
                     for r in reqs)
        if edited:
            logits = logits.float().clone()
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            apply_logit_bias(logits, biased, [reqs[i].params for i in biased])
        penalized = [i for i, r in enumerate(reqs) if r.params.penalized]
        if penalized:
            apply_penalties(logits, penalized, [reqs[i].params for i in penalized],
                            [reqs[i].prompt_token_ids for i in penalized],
                            [reqs[i].output_token_ids for i in penalized])
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            from .structured.grammar import apply_masks  # llguidance loads on first use

            apply_masks(logits, constrained, [reqs[i].grammar for i in constrained])
        gens = [self.request_generator(r) for r in reqs]
        return sample(logits, [r.params for r in reqs], gens)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        self.pool.copy_pages(pairs)

    @torch.inference_mode()
    def prompt_logits(self, items: list[tuple[Request, int]]) -> torch.Tensor:
        """Logits of every new token of a one-request batch (for tests and scoring)."""
        batch = self.prepare(items).batch
        return self.model.compute_logits(self.hidden(batch)).float()

    def request_generator(self, r: Request) -> torch.Generator | None:
        """Every sampling request draws from its own generator: its seed, or one derived from
        the engine seed and its id, so no request's draws depend on what else ran (or on the
        dropped extra tokens of overlap scheduling)."""
        if r.params.greedy:
            return None
        if r.generator is None:
            seed = r.params.seed
            if seed is None:
                digest = hashlib.blake2b(f"{self.config.seed}|{r.request_id}".encode(), digest_size=8)
                seed = int.from_bytes(digest.digest(), "little") >> 1
            r.generator = torch.Generator(device=self.device).manual_seed(seed)
        return r.generator
