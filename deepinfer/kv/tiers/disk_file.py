"""The L3 file format: a prefix, a JSON header and the payload, checksummed.

A file is::

    b"DIKV" | version: u16 | header_len: u32 | header JSON (header_len bytes) | payload

The JSON header holds ``namespace`` (model + layout + codec + page size), ``key``, ``token_count``,
``payload_len``, ``checksum`` and ``checksum_alg``. Files are written with ``crc32`` (zlib's CRC-32
of the payload): it detects what a cache must catch (bit flips, torn and truncated writes; every
burst error up to 32 bits, anything else but 1 in 2**32) faster than blake2b in software, and on
the read path the checksum is what bounds L3 throughput (docs/architecture.md has the figures). Files without ``checksum_alg`` are
blake2b-128 (the first writer's choice) and are still verified as such.

``namespace=None`` (maintenance) accepts a file of any namespace.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

MAGIC = b"DIKV"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHI")  # magic, version, header_len
MAX_HEADER = 64 * 1024
CHECKSUM_ALG = "crc32"


def checksum(payload: bytes | memoryview, alg: str = CHECKSUM_ALG) -> str | None:
    """Hex checksum of ``payload`` by ``alg`` (None for an algorithm we do not know)."""
    if alg == "crc32":
        return f"{zlib.crc32(payload):08x}"
    if alg == "blake2b":
        return hashlib.blake2b(payload, digest_size=16).hexdigest()
    return None


class BadFile(Exception):
    """A file that cannot be used. kind: 'corrupt' | 'checksum' | 'foreign' | 'missing'."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def file_head(namespace: str | None, key: str, payload: bytes, token_count: int) -> bytes:
    """Everything before the payload (written separately: no copy of a large page)."""
    header = json.dumps(
        {"namespace": namespace, "key": key, "token_count": int(token_count),
         "payload_len": len(payload), "checksum": checksum(payload),
         "checksum_alg": CHECKSUM_ALG},
        separators=(",", ":"),
    ).encode()  # fmt: skip
    return PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def parse_header(namespace: str | None, key: str, data: bytes) -> tuple[dict, int]:
    """-> (header, payload offset). Raises BadFile. Works on a prefix of the file too."""
    if len(data) < PREFIX.size:
        raise BadFile("corrupt", "empty or truncated prefix")
    magic, version, hlen = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadFile("corrupt", "bad magic")
    if version != FORMAT_VERSION:
        raise BadFile("foreign", f"format version {version}")
    if hlen > MAX_HEADER or PREFIX.size + hlen > len(data):
        raise BadFile("corrupt", "truncated header")
    try:
        header = json.loads(data[PREFIX.size : PREFIX.size + hlen])
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except ValueError as e:
        raise BadFile("corrupt", f"bad header: {e}") from None
    if namespace is not None and header.get("namespace") != namespace:
        raise BadFile("foreign", f"namespace {header.get('namespace')!r}")
    if header.get("key") != key:
        raise BadFile("corrupt", "key mismatch")
    if not isinstance(header.get("payload_len"), int) or not isinstance(header.get("checksum"), str):
        raise BadFile("corrupt", "bad header fields")
    return header, PREFIX.size + hlen


def parse_file(namespace: str | None, key: str, data: bytes) -> tuple[dict, memoryview]:
    """-> (header, payload) of a whole file. Raises BadFile."""
    header, off = parse_header(namespace, key, data)
    payload = memoryview(data)[off:]
    if header.get("payload_len") != len(payload):
        raise BadFile("corrupt", "payload length mismatch (truncated?)")
    alg = header.get("checksum_alg", "blake2b")
    if not isinstance(alg, str) or checksum(b"", alg) is None:
        raise BadFile("corrupt", f"unknown checksum algorithm {alg!r}")
    if header.get("checksum") != checksum(payload, alg):
        raise BadFile("checksum", "checksum mismatch")
    return header, payload
