"""Chained page hashes: the content address of every cached page.

A page's hash covers its parent's hash and its own token ids, so equal hashes mean equal
token prefixes. The root hash covers the model identity (weights fingerprint, KV layout,
dtype, page size) and the request's cache salt, so tenants and models never share entries.
Only blake2b over fixed byte encodings is used: stable across processes and restarts
(no Python ``hash()``, no random seeds), which the disk tier relies on.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(model_identity: str, cache_salt: str | None = None) -> bytes:
    """Hash that every chain of one (model, salt) namespace starts from."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"deepinfer-root")
    h.update(model_identity.encode())
    h.update(b"\x00salt\x00")
    h.update((cache_salt or "").encode())
    return h.digest()


def _page_hash(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"deepinfer-page")
    h.update(array("q", page_tokens).tobytes())
    return h.digest()


def chain_hashes(
    tokens: Sequence[int], page_size: int, parent: bytes, start_page: int = 0
) -> list[bytes]:
    """Hashes of every *full* page of ``tokens`` from ``start_page`` on.

    ``parent`` is the hash of page ``start_page - 1`` (or the root hash when 0), so a caller
    that already hashed a prefix only hashes the new pages.
    """
    out = []
    for p in range(start_page, len(tokens) // page_size):
        parent = _page_hash(parent, tokens[p * page_size : (p + 1) * page_size])
        out.append(parent)
    return out


def disk_key(page_hash: bytes, codec_tag: str) -> str:
    """L3 file key of a page: blake2b over its chained hash (which covers the model identity,
    layout, dtype, page size, salt and every token before it) and the disk codec's tag."""
    h = hashlib.blake2b(page_hash, digest_size=16, person=b"deepinfer-l3key")
    h.update(codec_tag.encode())
    return h.hexdigest()
