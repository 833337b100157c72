"""Pages sent straight from a prefill worker to a decode worker over a transfer engine (the
``--pd-transfer direct`` route of ``server/pd.py``; the other route goes through the store).

Both workers open a ``TransferLink``: Mooncake's transfer engine (``mooncake.engine``, TCP
here, RDMA where the NICs are) in its peer-to-peer handshake mode, so no metadata service is
needed. Each registers one ``Arena``, a host buffer it hands out in ranges: the prefill worker
keeps a request's encoded pages in its arena (``transfer_export.py``), the decode worker reads
them with one one-sided read into its own (``transfer_import.py``). A page travels in the bytes
a store keeps (``tiers/disk_file.py``: header bound to the page's chained hash and token ids,
codec-tagged payload, checksum), so the decode side checks it exactly as it checks a store's.

``TransferDescriptor`` is what the prefill worker answers and the decode worker is handed
(``x-deepinfer-kv-transfer``): where the pages lie, how many and how long each is, and where
their *manifest* lies (each page's chained hash and checksum, in order) with the manifest's
digest. The decode worker reads the manifest first, leaves out the leading pages its own tree
holds (earlier turns of a conversation), and reads only the rest, each page's checksum checked
against the manifest's. The pages' keys are in their own headers.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)


class TransferError(Exception):
    """The transfer engine is missing, failed to start, or a transfer failed."""


@dataclass(frozen=True)
class TransferDescriptor:
    transfer_id: str  # the prefill worker's name for the exported run (release, logs)
    session: str  # the prefill worker's transfer engine, "host:port"
    address: int  # first page's address in the prefill worker's arena
    page_bytes: int  # bytes of one page as stored (header, payload, checksum)
    pages: int  # consecutive pages from ``address``: the prompt's first full pages
    manifest_address: int  # ``pages`` entries: a page's chained hash, then its checksum
    tags: str  # hex xxh3-128 of the manifest (what the decode side must read)
    release_url: str  # POST here once pulled (a TTL frees the pages otherwise)

    def to_dict(self) -> dict[str, str | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, v: object) -> TransferDescriptor:
        """ValueError naming the field when ``v`` is not a descriptor."""
        if not isinstance(v, dict):
            raise ValueError("must be a JSON object")
        kinds = {"transfer_id": str, "session": str, "address": int, "page_bytes": int,
                 "pages": int, "manifest_address": int, "tags": str, "release_url": str}
        for name, kind in kinds.items():
            x = v.get(name)
            if not isinstance(x, kind) or isinstance(x, bool) or (kind is int and x < 0):
                raise ValueError(f"{name}: must be {'an integer >= 0' if kind is int else 'a string'}")
        return cls(**{k: v[k] for k in kinds})


class Arena:
    """A host buffer registered with a ``TransferLink`` (which it keeps alive: its engine
    serves peers' reads), handed out in byte ranges (first fit; freed ranges merge)."""

    def __init__(self, link: TransferLink, nbytes: int) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)  # touched now: no fault mid-transfer
        self.address = self.buffer.data_ptr()
        self.nbytes = nbytes
        self.link = link
        link.register(self.address, nbytes)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), by offset
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes, or None if no range is that long."""
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    self._free[i] = (off + n, length - n)
                    if length == n:
                        del self._free[i]
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        with self._lock:
            runs = sorted([*self._free, (off, n)])
            merged = [runs[0]]
            for o, length in runs[1:]:
                po, pl = merged[-1]
                if po + pl == o:
                    merged[-1] = (po, pl + length)
                else:
                    merged.append((o, length))
            self._free = merged

    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

    def view(self, off: int, n: int) -> memoryview:
        return memoryview(self.buffer[off : off + n].numpy())

    def close(self) -> None:
        """Unregister the buffer: peers can no longer read it (local reads still work)."""
        self.link.unregister(self.address)


class TransferLink:
    """One process's transfer engine. ``hostname``: the address peers reach it at;
    ``protocol``: "tcp" or "rdma" (then ``device``: the NIC, e.g. "mlx5_0")."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the package, or a library it links, is missing
            raise TransferError(f"Mooncake transfer engine not importable: {e}") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"transfer engine initialize({hostname}, {protocol}) -> {rc}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.protocol = protocol

    def register(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory of {nbytes} bytes -> {rc}")

    def unregister(self, address: int) -> None:
        self.engine.unregister_memory(address)

    def read(self, session: str, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``remote`` in ``session``'s registered memory to ``local`` in ours
        (blocking). TransferError if the peer is gone or the range is not registered there."""
        rc = self.engine.transfer_sync_read(session, local, remote, nbytes)
        if rc != 0:
            raise TransferError(f"read of {nbytes} bytes from {session} -> {rc}")


def open_link(hostname: str, protocol: str, device: str) -> TransferLink | None:
    """This process's transfer engine, or None (with a warning) where it cannot start: the
    caller then takes the store route."""
    try:
        return TransferLink(hostname, protocol, device)
    except TransferError as e:
        log.warning("--pd-transfer direct: %s; taking the store route instead", e)
        return None
