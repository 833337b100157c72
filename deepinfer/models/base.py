"""What every model offers the runner, and weight loading shared by all families."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.linear import FusedLinear


class CausalLM(nn.Module):
    """Base for our model classes: a decoder-only stack in HF's module layout.

    A subclass builds ``self.model`` (with ``embed_tokens``, ``layers`` whose ``self_attn`` has
    ``kv_spec()``, and ``norm``) and ``self.lm_head``, and overrides only what differs.
    ``fused_shards`` maps a checkpoint name fragment to (our fused module fragment, shard index),
    e.g. ``{"q_proj": ("qkv_proj", 0)}``; every other checkpoint tensor is copied by name.
    """

    fused_shards: dict[str, tuple[str, int]] = {}
    ignored_weights: tuple[str, ...] = (r"rotary_emb\.inv_freq",)
    # Parameters (regexes over our names) that stay float32 whatever the model dtype.
    fp32_params: tuple[str, ...] = ()
    # Linear layers (regexes over their weights' names) that ``--quantization`` leaves as they are:
    # those whose weight the model reads directly, and MoE routers (routing decisions are fragile).
    # Layers matching ``fp32_params`` stay unquantized too.
    unquantized_linears: tuple[str, ...] = ()

    def __init__(self, config, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def cast(self, dtype: torch.dtype) -> CausalLM:
        """Parameters to ``dtype``, except ``fp32_params``. Called on the meta device before
        loading, so no weight is ever rounded through ``dtype`` on its way to float32."""
        self.to(dtype)
        for name, p in self.named_parameters():
            if any(re.search(pattern, name) for pattern in self.fp32_params):
                p.data = p.data.float()
        return self

    def kv_specs(self) -> list[KVSpec]:
        return [layer.self_attn.kv_spec() for layer in self.model.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, batch: ForwardBatch, kv: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens; writes their KV into ``kv``."""
        x = self.embed(batch.input_ids)
        for i, (layer, layer_kv) in enumerate(zip(self.model.layers, kv)):
            x = layer(x, batch.for_layer(i), layer_kv)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(re.search(p, name) for p in self.ignored_weights):
                continue
            target = self.map_weight_name(name)
            if target is None:
                continue
            custom = self.load_custom_weight(target, tensor)
            if custom is not None:
                loaded.add(custom)
                continue
            for frag, (fused, shard) in self.fused_shards.items():
                if f".{frag}." in target:
                    mod_name, _, pname = target.replace(f".{frag}.", f".{fused}.").rpartition(".")
                    module = modules[mod_name]
                    assert isinstance(module, FusedLinear)
                    module.load_shard(shard, pname, tensor)
                    loaded.add(f"{mod_name}.{pname}")
                    break
            else:
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                p = params[target]
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(p.shape)}")
                p.data.copy_(tensor)
                loaded.add(target)
        self.tie_weights_if_needed(loaded)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:8]}")

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> our parameter name (None to skip)."""
        return name

    def load_custom_weight(self, target: str, tensor: torch.Tensor) -> str | None:
        """Hook for tensors that need more than a copy (e.g. one expert of a stacked tensor).

        Returns the name of the parameter it loaded, or None to fall through to the default.
        """
        return None

    _PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.(experts\.\d+\..*)$")

    def load_per_expert_weight(self, target: str, tensor: torch.Tensor) -> str | None:
        """``model.layers.N.mlp.experts.E.<proj>.weight`` into its ``MoEBlock``'s stacked experts
        (checkpoints name experts one by one); None when ``target`` is no such name."""
        from ..layers.moe import MoEBlock

        m = self._PER_EXPERT.match(target)
        if m is None:
            return None
        block = self.get_submodule(m.group(1))
        assert isinstance(block, MoEBlock)
        return f"{m.group(1)}.experts.{block.load_expert_weight(m.group(2), tensor)}"

    def tied_embeddings(self) -> bool:
        return bool(getattr(getattr(self, "config", None), "tie_word_embeddings", False))

    def tie_weights_if_needed(self, loaded: set[str]) -> None:
        """Share the input embedding with the LM head when the config ties them.

        Re-assigning matters: the runner builds the model on the meta device and then calls
        ``to_empty()``, which gives every module its own new tensor, silently untying parameters
        tied in ``__init__`` (the head would stay uninitialised when the checkpoint omits it).
        """
        if self.tied_embeddings():
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")

    def moe_stats(self) -> dict:
        """Tokens routed to each expert, per MoE layer: ``{"layers": {layer: {"last": [...],
        "total": [...], "steps": n}}, "num_experts": E, "top_k": K}`` (empty layers when dense).

        ``last`` is the latest forward step, ``total`` the sum since start (or the last reset);
        each layer's counts of a step sum to tokens x top_k.
        """
        from ..layers.moe import MoEBlock

        blocks = [m for m in self.modules() if isinstance(m, MoEBlock)]
        out: dict = {"layers": {}}
        if blocks:
            out["num_experts"] = blocks[0].num_experts
            out["top_k"] = blocks[0].top_k
        for b in blocks:
            out["layers"][b.layer_idx] = {"last": list(b.last_counts), "total": list(b.total_counts),
                                          "steps": b.steps}
        return out

    def reset_moe_stats(self) -> None:
        from ..layers.moe import MoEBlock

        for m in self.modules():
            if isinstance(m, MoEBlock):
                m.reset_stats()
