"""Offline API in the shape vLLM users know: ``LLM(model=...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from .chat import ChatSession, render_chat
from .config import EngineConfig
from .engine import LLMEngine
from .request_output import RequestOutput
from .sampling_params import SamplingParams
from .spec.config import SpeculativeConfig


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        if isinstance(engine_args.get("speculative_config"), dict):  # vLLM style: a plain dict
            engine_args["speculative_config"] = SpeculativeConfig(**engine_args["speculative_config"])
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(**{f.name: getattr(config, f.name) for f in fields(EngineConfig)})

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (text or token ids); outputs in input order,
        the ``n`` samples of each prompt one after the other (``RequestOutput.index``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        reqs = [self.engine.add_request(p, params, cache_salt=cache_salt) for p in prompts]
        return self.engine.run_to_completion(reqs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.tokenizer, conv) for conv in convs]
        return self.generate(prompts, sampling_params, cache_salt)

    def session(self) -> ChatSession:
        """A multi-turn conversation whose every turn extends the previous one token for token."""
        return ChatSession(self.tokenizer, self.engine.eos_token_ids)
