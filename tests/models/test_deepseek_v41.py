"""DeepSeek-V4.1 CSA2 (cross-layer long-KV sharing) against a dense reference written from the
published math (tests/models/csa2_reference.py): one prefill, chunked prefill, batched decode."""

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from csa2_reference import with_csa2_reference
from model_check import check_against_hf, randomize_
from test_deepseek_v4 import OTHER, PROMPT, TINY

from deepinfer.models.deepseek_v41_config import FULL, REINDEX, REUSE, WINDOW, DeepseekV41Config, csa2_layers

pytestmark = pytest.mark.usefixtures("one_thread")

# Every layer kind: window-only, FULL / REUSE / REINDEX at ratio 2, uncompressed long KV
# (ratio 1) with a REINDEX layer, and a FULL ratio-4 layer.
V41 = dict(compress_ratios=[0, 2, 2, 2, 2, 1, 1, 4, 0], kv_source_layer_ids=[1, 5, 7],
           index_source_layer_ids=[1, 3, 5, 6, 7])


def tiny_v41_config(**overrides):
    base = {k: v for k, v in TINY.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    fields = {**base, **V41, "use_cache": False, **overrides}
    n = len(fields["compress_ratios"])
    cfg = DeepseekV41Config(**{**fields, "num_hidden_layers": n, "mlp_layer_types": ["moe"] * n})
    cfg.architectures = ["DeepseekV41ForCausalLM"]
    return cfg


def tiny_v41(seed=0, **overrides):
    """transformers' V4 blocks with the CSA2 reference attention, random unit-gain weights."""
    cfg = tiny_v41_config(**overrides)
    torch.manual_seed(seed)
    model = with_csa2_reference(DeepseekV4ForCausalLM(cfg).eval())
    randomize_(model, seed)
    return model


def test_schedule_from_the_nemo_fields():
    modes = [(layer.mode, layer.kv_source, layer.selection_source) for layer in csa2_layers(tiny_v41_config())]
    assert modes == [(WINDOW, None, None), (FULL, 1, 1), (REUSE, 1, 1), (REINDEX, 1, 3), (REUSE, 1, 3),
                     (FULL, 5, 5), (REINDEX, 5, 6), (FULL, 7, 7), (WINDOW, None, None)]
    with pytest.raises(ValueError, match="earlier KV source of the same ratio"):
        tiny_v41_config(compress_ratios=[0, 2, 4, 2, 2, 1, 1, 4, 0])
    with pytest.raises(ValueError, match="window-only"):
        tiny_v41_config(index_source_layer_ids=[0, 1, 3, 5, 6, 7])
    with pytest.raises(ValueError, match="candidates would not match"):
        tiny_v41_config(candidate_source_layer_id=5)  # layer 7 starts another group
    roles = [layer.candidates for layer in csa2_layers(tiny_v41_config(**CANDIDATES))]
    assert roles == [None] * 5 + ["source", "masked", "masked", None]


# Hierarchical selection: layer 5 (FULL, r=1) keeps 2 blocks of 4 entries per query, and the
# REINDEX layers 6 and 7 after it pick their top-4 among those.
CANDIDATES = dict(compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[1, 5],
                  candidate_source_layer_id=5, candidate_topk_blocks=2, candidate_block_size=4)


@pytest.mark.parametrize("kw", [dict(index_topk=4), dict(index_topk=64), dict(index_topk=4, **CANDIDATES)],
                         ids=["sparse-topk", "all-entries", "candidate-blocks"])
def test_csa2_matches_dense_reference(kw):
    model = tiny_v41(**kw)
    diffs = check_against_hf(model, PROMPT, [5, 15, 17], OTHER, decode=6)
    assert max(diffs.values()) <= 1e-4, diffs
