"""L3 page files of a plain directory read and checked natively, a loader chunk per call
(``csrc/page_reads.cpp``).

Why: ``DiskStore.read_into`` spent more time per page in Python (the header's JSON, one hash
update per buffer, the binding checks) than in the read, all under the GIL, so the reader threads
of a load ran one at a time. The native call holds no GIL, and accepts a file only if its header
is byte for byte the one this store writes for that page (namespace, key, token count, payload
length, page hash, token digest, tag algorithm: every field ``PageFormat._check`` compares) and
its XXH3-128 tag over header and payload matches. A file it refuses (damaged, another page's, an
older header variant, gone) is read again by ``read_into``, which classifies, counts and
quarantines it as ever: the fast path can only accept what the precise one would.

``open_layers`` gives the op's ``LayerReads``: the same files and checks, each payload read a
layer group at a time (``layer_stream.py``'s native stream).

Only for XXH3-tagged stores (no secret: keyed BLAKE2 stays in Python) and where the op built and
found xxHash's symbols in the library the ``xxhash`` package loads; ``BatchReads.make`` is the one
check, None elsewhere (the caller keeps its per-page path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import torch
import xxhash

from ...native_build import NativeExtension, build_extension
from .disk_file import XXH3, PageId, tag_nbytes
from .disk_store import DiskStore

SOURCE = Path(__file__).parent / "csrc" / "page_reads.cpp"
_build_lock = threading.Lock()


@cache
def _build() -> NativeExtension:
    ext = build_extension("deepinfer_kv_reads", SOURCE, lambda: torch.ops.deepinfer_kv_reads.isa())
    if ext.loaded and not torch.ops.deepinfer_kv_reads.bind_xxh3(xxhash._xxhash.__file__):
        return NativeExtension("", "xxhash's library exports no XXH3 symbols")
    return ext


def page_reads_kernel() -> NativeExtension:
    """Build (once per machine) and load the op; never raises."""
    with _build_lock:
        return _build()


class BatchReads:
    """Reads of one store's tree pages (``token_count`` tokens, ``payload_len`` bytes each)."""

    def __init__(self, store: DiskStore, token_count: int, payload_len: int) -> None:
        self.store, self.token_count, self.payload_len = store, token_count, payload_len
        self.tag_len = tag_nbytes(XXH3)

    @staticmethod
    def make(store: object, token_count: int, payload_len: int) -> BatchReads | None:
        """A ``BatchReads`` where ``store`` is a plain directory whose tags the op checks."""
        if (not isinstance(store, DiskStore) or store.format.tag_alg != XXH3
                or not page_reads_kernel().loaded):
            return None
        return BatchReads(store, token_count, payload_len)

    def read(self, keys: Sequence[str], ids: Sequence[PageId | None], buffers: list[torch.Tensor],
             pages: Sequence[int], views: Callable[[int], list[memoryview]]) -> int:
        """Files ``keys`` (holding pages ``ids``) into page ``pages[i]`` of every buffer (CPU,
        contiguous, [num_pages, ...]; ``views(i)``: the same page's bytes, for the per-page path).
        -> how many leading files are in place and checked; the first miss ends the run."""
        i = 0
        while i < len(keys):
            j = i
            while j < len(keys) and ids[j] is not None:  # an unchecked page has no known header
                j += 1
            i += self._native(keys[i:j], ids[i:j], buffers, pages[i:j])
            if i == len(keys):
                break
            # refused: the precise path decides (an unchecked page, another header, or a miss)
            if not self.store.read_into(keys[i], views(i), ids[i]):
                break
            i += 1
        return i

    def open_layers(self, keys: Sequence[str], ids: Sequence[PageId],
                    first: int) -> tuple[torch.ScriptObject, list[int]]:
        """The op's ``LayerReads`` over files ``keys`` (holding pages ``ids``): their payloads
        read in pieces (``layer_stream.py``), the first ``first`` bytes long; and the files'
        sizes, for ``count_hits``."""
        heads = self._heads(keys, ids)
        reads = torch.classes.deepinfer_kv_reads.LayerReads(
            [self.store.file_path(k) for k in keys], *self._packed(heads), self.payload_len, first)
        return reads, [len(h) + self.payload_len + self.tag_len for h in heads]

    def count_hits(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Count files the op read and checked (``sizes`` bytes each) as the store's hits."""
        self.store.count_hits(list(zip(keys, sizes)), self.payload_len)

    def _heads(self, keys: Sequence[str], ids: Sequence[PageId | None]) -> list[bytes]:
        """The headers the store writes for these pages."""
        return [self.store.format.head(k, self.payload_len, self.token_count, p) for k, p in zip(keys, ids)]

    @staticmethod
    def _packed(heads: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Headers concatenated (uint8) and their offsets, as the op takes them."""
        offsets = [0]
        for h in heads:
            offsets.append(offsets[-1] + len(h))
        return torch.frombuffer(bytearray(b"".join(heads)) or bytearray(1), dtype=torch.uint8), torch.tensor(offsets)

    def _native(self, keys: Sequence[str], ids: Sequence[PageId | None], buffers: list[torch.Tensor],
                pages: Sequence[int]) -> int:
        if not keys:
            return 0
        heads = self._heads(keys, ids)
        n = torch.ops.deepinfer_kv_reads.read_pages(
            [self.store.file_path(k) for k in keys], *self._packed(heads), buffers, torch.tensor(list(pages)),
            self.store.touch_on_hit)
        self.count_hits(keys[:n], [len(h) + self.payload_len + self.tag_len for h in heads[:n]])
        return n
