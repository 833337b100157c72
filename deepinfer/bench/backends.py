"""What the engine-mode driver runs a workload on: an in-process ``LLMEngine`` (``EngineBackend``)
or transformers ``generate`` on the same checkpoint (``TransformersBackend``, the baseline)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepinfer.request import Request


@dataclass
class Finished:
    """A request that ended, as a backend reports it (times: ``perf_counter`` seconds)."""

    request_id: str
    first_token_time: float | None
    finish_time: float
    prompt_tokens: int
    output_ids: list[int]
    text: str
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class Backend(Protocol):
    """Requests in, finished requests out, one ``step()`` at a time."""

    tokenizer: Any  # a transformers tokenizer (chat template, decode)
    vocab_size: int

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Finished]: ...

    def arrival_time(self, request_id: str) -> float | None:
        """When the backend took the request (``perf_counter`` seconds), if it knows."""

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineBackend:
    """An ``LLMEngine`` built from ``EngineConfig(**kwargs)``."""

    def __init__(self, engine_kwargs: Mapping[str, Any], *, temperature: float = 0.0,
                 ignore_eos: bool = True) -> None:
        from deepinfer.config import EngineConfig
        from deepinfer.engine import LLMEngine

        kw = {"progress": False, **engine_kwargs}
        self.engine = LLMEngine(EngineConfig(**kw))
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = set(self.engine.eos_token_ids)
        self.vocab_size = self.engine.hf_config.vocab_size
        self.page_size = self.engine.config.page_size
        self.max_model_len = self.engine.max_model_len
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self._reqs: dict[str, Request] = {}
        # engine.Request times are time.monotonic(); records use perf_counter()
        self._clock_shift = time.perf_counter() - time.monotonic()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        from deepinfer.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                ignore_eos=self.ignore_eos)
        self._reqs[request_id] = self.engine.add_request(prompt_ids, params, request_id=request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[Finished]:
        out = []
        for req in self.engine.step():
            if not req.is_finished:
                continue
            self._reqs.pop(req.request_id, None)
            o = self.engine.make_output(req)
            shift = self._clock_shift
            out.append(Finished(
                request_id=req.request_id,
                first_token_time=(None if req.first_token_time is None
                                  else req.first_token_time + shift),
                finish_time=(req.finish_time if req.finish_time is not None
                             else time.monotonic()) + shift,
                prompt_tokens=o.num_prompt_tokens, output_ids=list(o.token_ids), text=o.text,
                cached_tokens=o.num_cached_tokens, cached_by_tier=dict(o.cached_tokens_by_tier)))
        return out

    def arrival_time(self, request_id: str) -> float | None:
        req = self._reqs.get(request_id)
        return None if req is None else req.arrival_time + self._clock_shift

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.shutdown()  # let queued L2/L3 writes land, stop the tier threads
        self.engine = None  # type: ignore[assignment]


class _FirstTokenTimer:
    """A ``generate`` streamer that notes when the first generated token comes out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersBackend:
    """transformers ``generate`` on the same checkpoint folder: fp32, one request at a time,
    greedy, no cache kept across requests (each request prefills its whole prompt)."""

    def __init__(self, checkpoint_path: str, *, ignore_eos: bool = True,
                 eos_token_ids: Sequence[int] = (), tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint_path, dtype=torch.float32).eval()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(checkpoint_path)
        self.ignore_eos = ignore_eos
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = self.model.config.vocab_size
        self._queue: list[tuple[str, list[int], int, float]] = []

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        self._queue.append((request_id, prompt_ids, max_tokens, time.perf_counter()))

    def has_work(self) -> bool:
        return bool(self._queue)

    def arrival_time(self, request_id: str) -> float | None:
        return next((t for rid, _, _, t in self._queue if rid == request_id), None)

    def step(self) -> list[Finished]:
        rid, ids, max_tokens, _ = self._queue.pop(0)
        torch = self.torch
        timer = _FirstTokenTimer()
        x = torch.tensor([ids])
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": False,
                              "pad_token_id": self.eos_token_ids[0] if self.eos_token_ids else 0}
        if self.ignore_eos:
            kw.update(min_new_tokens=max_tokens, eos_token_id=None)
        elif self.eos_token_ids:
            kw["eos_token_id"] = self.eos_token_ids
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=timer, **kw)
        end = time.perf_counter()
        new = out[0, len(ids):].tolist()
        if not self.ignore_eos:
            cut = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
            new = new if cut is None else new[: cut + 1]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return [Finished(request_id=rid, first_token_time=timer.first or end, finish_time=end,
                         prompt_tokens=len(ids), output_ids=new, text=text,
                         cached_by_tier={})]

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.model = None
