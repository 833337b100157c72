"""KVSpec extensions for compressed KV: packed entry rows per page, namespaces, and window groups
whose rings feed paged state (they replay from position 0)."""

import pytest
import torch

from deepinfer.kv.layout import KVSpec, describe
from deepinfer.kv.pool import PagePool
from deepinfer.kv.window.layout import REPLAY_ALL, WindowLayout

RING = KVSpec((("kv", (1, 4)),), window=8)
ENTRIES = KVSpec((("entry", (1, 4)),), tokens_per_entry=4)


def test_entry_rows_per_page():
    assert [ENTRIES.rows_per_page(p) for p in (4, 16, 6, 2)] == [1, 4, 2, 1]
    pool = PagePool([ENTRIES], 3, 16, torch.float32, torch.device("cpu"))
    assert pool.buffers[0]["entry"].shape == (3, 4, 1, 4)
    assert PagePool.bytes_per_page([ENTRIES], 16, torch.float32) == 4 * 4 * 4


def test_stride_is_part_of_the_namespace_only_when_used():
    assert describe([RING]) == "0:kv[1, 4]:w8:sNone"
    assert describe([ENTRIES]).endswith(":e4")


def test_rings_feeding_pages_replay_from_start():
    assert WindowLayout.from_specs([RING, RING]).replay_tokens == 14
    feeding = KVSpec(RING.components, window=8, feeds_pages=True)
    assert WindowLayout.from_specs([RING, feeding, ENTRIES]).replay_tokens == REPLAY_ALL
    with pytest.raises(ValueError, match="one entry per token"):
        WindowLayout.from_specs([KVSpec(RING.components, window=8, tokens_per_entry=2)])
