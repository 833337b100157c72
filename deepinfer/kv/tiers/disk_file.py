"""The L3 page file format, bound to the page it holds.

A file is::

    b"DIKV" | version: u16 | header_len: u32 | header JSON | payload | tag

The header holds ``namespace`` (model + layout + codec + page size), ``key`` (the file name),
``token_count``, ``payload_len``, ``page`` (hex of the chained page hash the payload is the KV
of), ``tokens`` (hex digest of the page's token ids; null for files that are no tree page, such
as window snapshots) and ``tag_alg``. The tag covers everything before it, header included, so
no header field can change without the reader noticing, and a reader checks ``page`` and
``tokens`` against the page it asked for: a file moved into another page's place is a miss.

``tag_alg`` is ``xxh3-128`` (XXH3's 128-bit hash, 16 bytes) without a secret: it catches bit
flips, torn and truncated writes and misplaced files, but anyone who can write the directory can
compute it, so it does not stop a deliberate forgery. It replaced ``crc32`` (zlib's CRC-32, 4
bytes; files with it are still read) because it checks a page several times faster, and the
check is what bounded L3 load throughput. With a secret (``--kv-store-secret``) it is
``blake2b-keyed`` (BLAKE2b-256 keyed with the secret, 32 bytes): a file nobody without the key
could have made. A store with a secret refuses unkeyed files and vice versa (both are
"foreign": a miss, replaced by the next write of that page).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

MAGIC = b"DIKV"
FORMAT_VERSION = 2  # 1: checksum over the payload only, no page binding (read as foreign)
PREFIX = struct.Struct("<4sHI")  # magic, version, header_len
MAX_HEADER = 64 * 1024
HEAD_READ = 4096  # ``read_into``'s first read: prefix and header (a few hundred bytes)
XXH3, CRC32, KEYED = "xxh3-128", "crc32", "blake2b-keyed"
_TAG_BYTES = {XXH3: 16, CRC32: 4, KEYED: 32}


@dataclass(frozen=True)
class PageId:
    """What a page file must hold: the page's chained hash and, where known, the digest of
    its token ids (``tokens_digest``)."""

    page_hash: bytes
    tokens_digest: bytes | None = None


def page_id(page_hash: bytes, tokens: Sequence[int] | None = None) -> PageId:
    if tokens is None:
        return PageId(page_hash)
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-toks")
    h.update(array("q", tokens).tobytes())
    return PageId(page_hash, h.digest())


class TagHasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


class _Crc32:
    """zlib's CRC-32 as a ``TagHasher`` (the tag of older files)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def digest(self) -> bytes:
        return self.crc.to_bytes(4, "little")


class BadFile(Exception):
    """A file that cannot be used. kind: 'corrupt' | 'checksum' | 'mismatch' (another page's)
    | 'foreign' (another namespace, format or tag algorithm) | 'missing'."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class PageFormat:
    """Writes and checks page files of one namespace (None: any, for maintenance)."""

    def __init__(self, namespace: str | None, secret: bytes | None = None) -> None:
        self.namespace = namespace
        self.secret = secret or None
        self.tag_alg = KEYED if self.secret else XXH3
        self._head_hint = 0  # header length of the last file ``read_into`` read in two steps
        self._head_start = '{"namespace":' + json.dumps(namespace) + ',"key":'  # (``head``)
        self._head_end = ',"tag_alg":' + json.dumps(self.tag_alg) + "}"

    def head(self, key: str, payload_len: int, token_count: int, page: PageId | None) -> bytes:
        """Everything before the payload (written separately: no copy of a large page). The
        JSON of ``json.dumps(..., separators=(",", ":"))``, put together from the parts that
        vary: a load builds the header of every page it reads (``batch_reads.py``), and
        encoding the namespace each time was most of that."""
        tokens = page.tokens_digest if page else None
        header = "".join((
            self._head_start, json.dumps(key), ',"token_count":', str(int(token_count)),
            ',"payload_len":', str(int(payload_len)),
            ',"page":', f'"{page.page_hash.hex()}"' if page else "null",
            ',"tokens":', f'"{tokens.hex()}"' if tokens else "null", self._head_end)).encode()
        return PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header

    def tag(self, *parts: bytes | memoryview, alg: str | None = None) -> bytes:
        alg = alg or self.tag_alg
        if alg == KEYED:
            h = hashlib.blake2b(key=self.secret, digest_size=32, person=b"deepinfer-l3")
            for p in parts:
                h.update(p)
            return h.digest()
        if alg == XXH3:
            x = xxhash.xxh3_128()
            for p in parts:
                x.update(p)
            return x.digest()
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc.to_bytes(4, "little")

    def parse_header(self, key: str, data: bytes | memoryview) -> tuple[dict, int]:
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
            header = json.loads(bytes(data[PREFIX.size : PREFIX.size + hlen]))
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
        except ValueError as e:
            raise BadFile("corrupt", f"bad header: {e}") from None
        if header.get("key") != key:
            raise BadFile("corrupt", "key mismatch")
        if not isinstance(header.get("payload_len"), int) or header.get("tag_alg") not in _TAG_BYTES:
            raise BadFile("corrupt", "bad header fields")
        return header, PREFIX.size + hlen

    def parse(self, key: str, data: bytes, expect: PageId | None = None
              ) -> tuple[dict, memoryview]:
        """Check a whole file: -> (header, payload). Raises BadFile. Namespace and tag
        algorithm are checked after the tag, so a damaged header is a checksum failure."""
        header, off = self.parse_header(key, data)
        n_tag = _TAG_BYTES[header["tag_alg"]]
        if off + header["payload_len"] + n_tag != len(data):
            raise BadFile("corrupt", "length mismatch (truncated?)")
        mv = memoryview(data)
        self._check(header, [mv[:off], mv[off : len(data) - n_tag]], mv[len(data) - n_tag :], expect)
        return header, mv[off : off + header["payload_len"]]

    def read_into(self, fd: int, key: str, dest: Sequence[memoryview],
                  expect: PageId | None = None) -> tuple[int, int]:
        """Read the payload of the open file ``fd`` straight into ``dest`` (filled in order; their
        sizes sum to the payload's, else it is a "foreign" miss) and check it there, as ``parse``
        does; -> (the file's size, the payload's). Raises BadFile (``dest`` then holds garbage) or OSError.

        One ``preadv`` does it when the header is as long as the last one this format read (the
        headers of one store's pages are): header, payload, tag and one byte past the end (which
        must stay unread) at once. Otherwise the header is read first, then the rest."""
        want = sum(d.nbytes for d in dest)
        hint, n_tag = self._head_hint, _TAG_BYTES[self.tag_alg]
        if hint:
            head, tag, past = bytearray(hint), bytearray(n_tag), bytearray(1)
            got = os.preadv(fd, [head, *dest, tag, past], 0)
            header, off = self._parse_hinted(key, head) if got == hint + want + n_tag else ({}, 0)
            if off == hint and header["payload_len"] == want and header["tag_alg"] == self.tag_alg:
                self._check(header, [memoryview(head), *dest], tag, expect)
                return got, want
        header, head, size = self.read_head(fd, key, want)
        off = len(head)
        tag = bytearray(_TAG_BYTES[header["tag_alg"]])
        if os.preadv(fd, [*dest, tag], off) != want + len(tag):
            raise BadFile("corrupt", "short read (truncated meanwhile?)")
        self._check(header, [head, *dest], tag, expect)
        self._head_hint = off
        return size, want

    def read_head(self, fd: int, key: str, payload_len: int) -> tuple[dict, memoryview, int]:
        """The header of the open file ``fd``, whose payload must be ``payload_len`` bytes (else
        a "foreign" miss): -> (header, the bytes before the payload, the file's size). Raises
        BadFile or OSError."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, min(size, HEAD_READ), 0)
        if len(head) >= PREFIX.size and PREFIX.size + PREFIX.unpack_from(head)[2] > len(head):
            head = os.pread(fd, min(size, PREFIX.size + MAX_HEADER), 0)  # a long header
        header, off = self.parse_header(key, head)
        if off + header["payload_len"] + _TAG_BYTES[header["tag_alg"]] != size:
            raise BadFile("corrupt", "length mismatch (truncated?)")
        if header["payload_len"] != payload_len:  # the reader's layout, not the file, differs
            raise BadFile("foreign", f"payload of {header['payload_len']} bytes, {payload_len} expected")
        return header, memoryview(head)[:off], size

    def hasher(self, alg: str) -> TagHasher:
        """An incremental tag of algorithm ``alg``: update with every part before the tag, in
        file order, then ``check`` it (a file read in pieces: ``layer_stream.py``)."""
        if alg == KEYED:
            if self.secret is None:
                raise BadFile("foreign", "keyed file, and this store has no secret")
            return hashlib.blake2b(key=self.secret, digest_size=32, person=b"deepinfer-l3")
        return xxhash.xxh3_128() if alg == XXH3 else _Crc32()

    def check(self, header: dict, digest: bytes, tag: bytes | memoryview,
              expect: PageId | None) -> None:
        """``_check`` of a tag computed by ``hasher``. Raises BadFile."""
        self._check(header, [], tag, expect, digest)

    def _parse_hinted(self, key: str, head: bytearray) -> tuple[dict, int]:
        """``parse_header`` of a guessed header length: ({}, 0) where the guess was wrong."""
        try:
            return self.parse_header(key, head)
        except BadFile:
            return {}, 0

    def _check(self, header: dict, parts: Sequence[bytes | memoryview], tag: bytes | memoryview,
               expect: PageId | None, digest: bytes | None = None) -> None:
        """The tag over ``parts`` (everything before it; or its ``digest``, computed by the
        caller), then namespace and page binding."""
        alg = header["tag_alg"]
        if alg == KEYED and self.secret is None:
            raise BadFile("foreign", "keyed file, and this store has no secret")
        if digest is None:
            digest = self.tag(*parts, alg=alg)
        if not hmac.compare_digest(digest, bytes(tag)):
            raise BadFile("checksum", "tag mismatch (damaged, or written without the secret)")
        if self.secret is not None and alg != KEYED:
            raise BadFile("foreign", "unkeyed file, and this store requires the secret")
        if self.namespace is not None and header.get("namespace") != self.namespace:
            raise BadFile("foreign", f"namespace {header.get('namespace')!r}")
        if expect is not None:
            if header.get("page") != expect.page_hash.hex():
                raise BadFile("mismatch", "the file holds another page")
            if expect.tokens_digest is not None and header.get("tokens") is not None \
                    and header["tokens"] != expect.tokens_digest.hex():
                raise BadFile("mismatch", "the file holds other token ids")


def tag_nbytes(alg: str) -> int:
    """Bytes of a tag of algorithm ``alg`` (a header's ``tag_alg``)."""
    return _TAG_BYTES[alg]
