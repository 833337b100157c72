"""Wire clients of the networked L3 stores (``KVClient``), ``open_remote_store``, which
turns a ``--kv-store`` URL and its options into a ``RemoteStore``, and ``open_l3_store``, the
page store the engine's L3 reads (a local directory, a networked store, or the first in front).

* ``mooncake://MASTER_HOST:PORT``: Mooncake Store (``mooncake_master`` holds the metadata; the
  memory is the global segments that clients mount: ``mooncake_client`` processes, or the
  engine itself with ``global_segment_size``). Options: ``local_hostname`` (127.0.0.1),
  ``metadata_server`` (default: the master's own HTTP metadata server,
  ``http://MASTER_HOST:8080/metadata``; or P2PHANDSHAKE, or etcd), ``protocol`` (tcp; rdma where present), ``device_name``,
  ``global_segment_size`` (bytes this engine lends the pool, default 0),
  ``local_buffer_size`` (bytes of the client's transfer buffer, default 128 MiB).
* ``redis://HOST:PORT[/DB]``: Redis or Valkey (``redis-py``). Options: ``password``,
  ``ttl_s`` (none: the server's ``maxmemory-policy`` evicts).

Options of every store: ``timeout_s`` (2), the longest a call is waited for; ``retry_s`` (5),
seconds between probes of a store that is down.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from .disk_store import DiskStore
from .page_store import PageStore
from .remote_store import KVClient, LayeredStore, RemoteStore

SCHEMES = ("mooncake", "redis")


class StoreError(Exception):
    """A store call that failed (the store's own error code)."""


class MooncakeClient(KVClient):
    """Connects on first use (and again after a failed setup), so that an engine starts, and
    serves from its local tiers, while the master is down."""

    def __init__(self, host: str, port: int, *, local_hostname: str = "127.0.0.1",
                 metadata_server: str | None = None, protocol: str = "tcp",
                 device_name: str = "", global_segment_size: int = 0,
                 local_buffer_size: int = 128 << 20, timeout_s: float = 2.0) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError("--kv-store mooncake:// needs the mooncake-transfer-engine-non-cuda "
                             "package (scripts/setup.sh installs it)") from e
        self.url = f"mooncake://{host}:{port}"
        self.timeout_s = timeout_s
        self.max_batch_bytes = local_buffer_size // 2  # one put must fit the transfer buffer
        self._new_store = MooncakeDistributedStore
        metadata_server = metadata_server or f"http://{host}:8080/metadata"
        self._setup_args = (local_hostname, metadata_server, global_segment_size,
                            local_buffer_size, protocol, device_name, f"{host}:{port}")
        self._conn: MooncakeDistributedStore | None = None
        # one call at a time: concurrent calls into the client crashed it (SIGSEGV) when the
        # master died under them
        self._connecting = threading.RLock()

    @property
    def _store(self):  # noqa: ANN202 - the extension's own type
        with self._connecting:
            if self._conn is None:
                # setup() holds the GIL while it retries an absent master (for minutes): ask
                # the master's port first, so a store that is down costs one connect timeout
                host, _, port = self._setup_args[-1].rpartition(":")
                socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
                store = self._new_store()
                rc = store.setup(*self._setup_args)
                if rc != 0:
                    raise StoreError(f"setup with master {self._setup_args[-1]} failed (code {rc})")
                self._conn = store
            return self._conn

    def _drop(self) -> None:
        """Forget a client that failed: calls into it after its master died crashed the
        process, so the next call connects afresh (once the master's port answers)."""
        with self._connecting:
            self._conn = None

    def exists(self, keys: list[str]) -> list[bool]:
        with self._connecting:
            codes = self._store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            self._drop()
            raise StoreError(f"batch_is_exist returned {min(codes)}")
        return [c == 1 for c in codes]

    def get(self, keys: list[str]) -> list[bytes | None]:
        with self._connecting:
            got = self._store.get_batch(keys)
        return [v if v else None for v in got]  # a miss reads b""

    def put(self, keys: list[str], values: list[bytes]) -> None:
        i = 0
        while i < len(keys):  # batches that fit the transfer buffer
            j, size = i, 0
            while j < len(keys) and (j == i or size + len(values[j]) <= self.max_batch_bytes):
                size += len(values[j])
                j += 1
            with self._connecting:
                rc = self._store.upsert_batch(keys[i:j], values[i:j])  # upsert: replaces a bad page
            if rc != 0:
                self._drop()
                raise StoreError(f"upsert_batch returned {rc}")
            i = j

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class RedisClient(KVClient):
    def __init__(self, host: str, port: int, db: int = 0, *, password: str | None = None,
                 timeout_s: float = 2.0, ttl_s: int | None = None) -> None:
        try:
            import redis
        except ImportError as e:
            raise ValueError("--kv-store redis:// needs the redis package (pip install redis)") from e
        self.url = f"redis://{host}:{port}/{db}"
        self.ttl_s = ttl_s
        self._redis = redis.Redis(host=host, port=port, db=db, password=password,
                                  socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(n) for n in pipe.execute()]

    def get(self, keys: list[str]) -> list[bytes | None]:
        return list(self._redis.mget(keys))

    def put(self, keys: list[str], values: list[bytes]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v, ex=self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        self._redis.close()


def parse_store_options(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--kv-store-option``) -> a dict; ValueError names a bad one."""
    out: dict[str, str] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"--kv-store-option must be KEY=VALUE, got {p!r}")
        out[key.strip()] = value.strip()
    return out


_INT_OPTIONS = {"global_segment_size", "local_buffer_size", "ttl_s"}
_FLOAT_OPTIONS = {"retry_s", "timeout_s"}
_COMMON = {"retry_s", "timeout_s"}
_OPTIONS = {"mooncake": {"local_hostname", "metadata_server", "protocol", "device_name",
                         "global_segment_size", "local_buffer_size"},
            "redis": {"password", "ttl_s"}}


def check_store_url(url: str, options: dict[str, str]) -> tuple[str, str, int, dict[str, str | int | float]]:
    """-> (scheme, host, port, typed options); ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"kv_store must be mooncake://HOST:PORT or redis://HOST:PORT, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"kv_store needs HOST:PORT, got {url!r}")
    typed: dict[str, str | int | float] = {}
    for key, value in options.items():
        if key not in _OPTIONS[parts.scheme] | _COMMON:
            known = ", ".join(sorted(_OPTIONS[parts.scheme] | _COMMON))
            raise ValueError(f"unknown {parts.scheme} store option {key!r} (known: {known})")
        try:
            typed[key] = int(value) if key in _INT_OPTIONS else float(value) if key in _FLOAT_OPTIONS else value
        except ValueError:
            raise ValueError(f"store option {key} must be a number, got {value!r}") from None
    return parts.scheme, parts.hostname, port, typed


def open_remote_store(url: str, options: dict[str, str], namespace: str, *,
                      secret: bytes | None = None) -> RemoteStore:
    """A ``RemoteStore`` on ``url``. A store that cannot be reached at start-up is one that is
    down: the engine serves from its local tiers and retries (``RemoteStore``)."""
    scheme, host, port, typed = check_store_url(url, options)
    retry_s = float(typed.pop("retry_s", 5.0))
    timeout_s = float(typed.pop("timeout_s", 2.0))
    if scheme == "mooncake":
        client: KVClient = MooncakeClient(host, port, timeout_s=timeout_s, **typed)  # type: ignore[arg-type]
    else:
        db = int(urlsplit(url).path.strip("/") or 0)
        client = RedisClient(host, port, db, timeout_s=timeout_s, **typed)  # type: ignore[arg-type]
    return RemoteStore(client, namespace, secret=secret, retry_s=retry_s, timeout_s=timeout_s)


def open_l3_store(disk_dir: str | os.PathLike[str] | None, disk_bytes: int, namespace: str,
                  kv_store: str | None, options: dict[str, str], secret: bytes | None
                  ) -> tuple[PageStore, RemoteStore | None]:
    """The L3 page store (the local directory in front of the networked store when both are
    configured), and the networked store alone (None without one)."""
    remote = (open_remote_store(kv_store, options, namespace, secret=secret)
              if kv_store is not None else None)
    local = DiskStore(disk_dir, disk_bytes, namespace, secret=secret) if disk_dir is not None else None
    if local is not None and remote is not None:
        return LayeredStore(local, remote), remote
    store = local if local is not None else remote
    assert store is not None, "an L3 store needs a directory or a --kv-store URL"
    return store, remote
