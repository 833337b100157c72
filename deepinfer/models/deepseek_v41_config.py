"""DeepSeek-V4.1's CSA2 schedule: which layers compute long KV and which reuse another's.

V4.1 configures attention per layer with three fields (names as in NVIDIA NeMo Automodel's
``DeepseekV41TextConfig``): ``compress_ratios`` (0 = sliding window only, 1 = every token's own
long-KV entry, 2 / 4 / 128 = one gated-pooled entry per that many tokens),
``kv_source_layer_ids`` (layers that compute compressed KV and indexer keys) and
``index_source_layer_ids`` (layers that pick their own top-k entries). A compressed layer is:

* ``full``: a KV source: compresses, keys its entries for the indexer, selects;
* ``reindex``: an index source only: scores the latest KV source's keys with its own indexer
  queries and selects its own top-k;
* ``reuse``: neither: reads the latest KV source's entries with the latest index source's top-k.

``candidate_source_layer_id`` (>= 0) adds V4.1's hierarchical selection: that FULL layer also
keeps, per query, its ``candidate_topk_blocks`` best blocks of ``candidate_block_size`` entries
(by their best score, the latest visible block always), and the later index layers of its group
pick their top-k among those candidates only.

The rest of the block (mHC, MoE) is V4's: ``DeepseekV41Config`` is a ``DeepseekV4Config``
whose ``layer_types`` follow from ``compress_ratios``.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig, DeepseekV4Config

WINDOW, FULL, REINDEX, REUSE = "window", "full", "reindex", "reuse"
SOURCE, MASKED = "source", "masked"  # a layer's part in the hierarchical candidate selection


class DeepseekV41Config(DeepseekV4Config):
    model_type = "deepseek_v41"

    compress_ratios: list[int] | None = None
    kv_source_layer_ids: list[int] | None = None
    index_source_layer_ids: list[int] | None = None
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8

    def __post_init__(self, **kwargs):
        # transformers builds a bare instance for its defaults (save_pretrained's diff): the
        # schedule is checked whenever it is given, and required by csa2_layers
        if self.compress_ratios is not None and self.layer_types is None:
            self.layer_types = ["sliding_attention" if r == 0 else "compressed_sparse_attention"
                                for r in self.compress_ratios[: self.num_hidden_layers]]
        super().__post_init__(**kwargs)
        if self.compress_ratios is not None:
            csa2_layers(self)


AutoConfig.register(DeepseekV41Config.model_type, DeepseekV41Config)


@dataclass(frozen=True)
class CSA2Layer:
    """One layer's place in the schedule."""

    ratio: int  # 0: window only
    mode: str  # WINDOW, FULL, REINDEX or REUSE
    kv_source: int | None  # the FULL layer whose entries (and indexer keys) it reads
    selection_source: int | None  # the layer whose top-k choice it attends with
    candidates: str | None = None  # SOURCE: picks the candidate blocks; MASKED: selects among them


def csa2_layers(config: DeepseekV41Config) -> list[CSA2Layer]:
    """The schedule of ``config``'s layers; a clear error for one that cannot run."""
    if config.compress_ratios is None or config.kv_source_layer_ids is None \
            or config.index_source_layer_ids is None:
        raise ValueError("DeepSeek-V4.1 needs compress_ratios, kv_source_layer_ids and index_source_layer_ids")
    n = config.num_hidden_layers
    ratios = list(config.compress_ratios)
    kv_ids, index_ids = set(config.kv_source_layer_ids), set(config.index_source_layer_ids)
    if len(ratios) < n or any(not isinstance(r, int) or r < 0 for r in ratios):
        raise ValueError(f"compress_ratios must hold a ratio >= 0 for each of the {n} layers: {ratios}")
    if not kv_ids <= index_ids:
        raise ValueError("every kv_source_layer_ids entry must also be in index_source_layer_ids")
    out: list[CSA2Layer] = []
    kv_source = selection_source = None
    for i, r in enumerate(ratios[:n]):
        if r == 0:
            if i in index_ids:
                raise ValueError(f"layer {i} is window-only (ratio 0): it cannot be a KV or index source")
            out.append(CSA2Layer(0, WINDOW, None, None))
            continue
        if i in kv_ids:
            kv_source = i
        if kv_source is None or ratios[kv_source] != r:
            raise ValueError(f"compressed layer {i} (ratio {r}) needs an earlier KV source of the same ratio")
        if i in index_ids:
            selection_source = i
        mode = FULL if i == kv_source else REINDEX if i == selection_source else REUSE
        out.append(CSA2Layer(r, mode, kv_source, selection_source, _candidate_role(config, i, mode, kv_source)))
    return out


def _candidate_role(config: DeepseekV41Config, i: int, mode: str, kv_source: int) -> str | None:
    source = config.candidate_source_layer_id
    if source < 0 or i < source or mode == REUSE:
        return None
    if i == source:
        if mode != FULL:
            raise ValueError(f"candidate_source_layer_id {source} must be a KV source layer")
        return SOURCE
    if kv_source != source:
        raise ValueError(f"index layer {i} comes after candidate source {source} but reads layer "
                         f"{kv_source}'s entries: its candidates would not match")
    return MASKED
