"""RemoteStore against real Mooncake Store and Redis services on loopback: the same bytes as
an L3 file, bad pages as counted misses, a store killed and restarted."""

from __future__ import annotations

import os
import time

import pytest

from deepinfer.kv.tiers.disk_store import DiskStore
from deepinfer.kv.tiers.remote_store import LayeredStore
from deepinfer.kv.tiers.store_clients import check_store_url, open_remote_store, parse_store_options

NS = "model-x|codec=lossless"


def key(i: int) -> str:
    return f"{i:064x}"


def open_store(svc, namespace=NS, retry_s=0.5):
    return open_remote_store(svc.url, {**svc.options, "retry_s": str(retry_s)}, namespace)


def test_pages_round_trip_as_the_bytes_of_an_l3_file(store_service, tmp_path):
    store = open_store(store_service)
    pages = [(key(i), os.urandom(1000 + i), 4, None) for i in range(5)]
    assert store.put_many(pages) == [True] * 5
    assert [store.get(k) for k, _, _, _ in pages] == [p for _, p, _, _ in pages]
    assert store.contains(key(3)) and not store.contains(key(99)) and store.known(key(3))
    assert store.get(key(99)) is None
    # what the store holds is byte for byte what the directory store writes for that page
    disk = DiskStore(tmp_path, 1 << 30, NS)
    disk.put(*pages[0])
    assert store.client.get([key(0)])[0] == (tmp_path / key(0)[:2] / f"{key(0)}.kv").read_bytes()
    s = store.stats()
    assert (s["writes"], s["hits"], s["misses"], s["unavailable"]) == (5, 5, 1, 0)
    store.close()


def test_bad_and_foreign_pages_are_counted_misses(store_service):
    store = open_store(store_service)
    store.put_many([(key(10), b"a" * 500, 4, None), (key(11), b"b" * 500, 4, None)])
    raw = bytearray(store.client.get([key(10)])[0])
    raw[-1] ^= 0x01  # one flipped bit in the payload
    store.client.put([key(10)], [bytes(raw)])
    store.client.put([key(12)], [b"not a page"])
    assert store.get(key(10)) is None and store.get(key(12)) is None
    other = open_store(store_service, namespace="another-model|codec=lossless")
    assert other.get(key(11)) is None  # another model's page under the same key
    assert store.get(key(11)) == b"b" * 500
    s, o = store.stats(), other.stats()
    assert (s["checksum_failures"], s["corrupt_files"], s["misses"], s["hits"]) == (1, 1, 2, 1)
    assert (o["foreign_files"], o["misses"]) == (1, 1)
    store.put_many([(key(10), b"a" * 500, 4, None)])  # a rewrite replaces the bad page
    assert store.get(key(10)) == b"a" * 500
    store.close()
    other.close()


def test_layered_store_reads_the_directory_first_and_the_remote_for_the_rest(store_service, tmp_path):
    writer = LayeredStore(DiskStore(tmp_path / "a", 1 << 30, NS), open_store(store_service))
    assert writer.put_many([(key(20), b"x" * 300, 4, None)]) == [True]
    reader = LayeredStore(DiskStore(tmp_path / "b", 1 << 30, NS), open_store(store_service))
    assert reader.contains(key(20)) and reader.get(key(20)) == b"x" * 300
    assert reader.remote.stats()["hits"] == 1 and reader.local.stats()["hits"] == 0
    assert writer.get(key(20)) == b"x" * 300
    assert writer.remote.stats()["hits"] == 0 and writer.local.stats()["hits"] == 1
    writer.close()
    reader.close()


def test_a_killed_store_is_a_counted_miss_then_comes_back(store_service):
    store = open_store(store_service, retry_s=0.5)
    store.put_many([(key(30), b"z" * 200, 4, None)])
    store_service.kill()
    try:
        assert store.get(key(30)) is None  # the call that finds it gone
        assert store.put_many([(key(31), b"y" * 200, 4, None)]) == [False]
        assert not store.contains(key(30)) and not store.available()
        s = store.stats()
        assert s["outages"] == 1 and s["unavailable"] >= 2 and s["write_errors"] == 1
    finally:
        store_service.start()
    deadline = time.monotonic() + 60
    while not store.put_many([(key(32), b"w" * 200, 4, None)])[0]:  # a fresh service: retried after retry_s
        assert time.monotonic() < deadline, store.stats()
        time.sleep(0.2)
    assert store.available() and store.get(key(32)) == b"w" * 200
    assert store.stats()["outages"] == 1
    store.close()


@pytest.mark.parametrize("url", ["mooncake://127.0.0.1:1", "redis://127.0.0.1:1"])
def test_a_store_down_at_start_up_is_an_outage_not_an_error(url):
    store = open_remote_store(url, {"retry_s": "60", "timeout_s": "1"}, NS)  # nothing listens on port 1
    assert store.get(key(1)) is None and store.put_many([(key(1), b"q", 1, None)]) == [False]
    assert not store.contains(key(1)) and not store.available()
    s = store.stats()
    assert s["outages"] == 1 and s["unavailable"] == 3 and s["misses"] == 1
    store.close()


@pytest.mark.parametrize("url, options, why", [
    ("memcached://h:1", {}, "must be mooncake://"),
    ("redis://host", {}, "needs HOST:PORT"),
    ("redis://h:1", {"protocol": "tcp"}, "unknown redis store option 'protocol'"),
    ("mooncake://h:1", {"global_segment_size": "big"}, "must be a number"),
])
def test_bad_store_urls_and_options_are_clear_errors(url, options, why):
    with pytest.raises(ValueError, match=why):
        check_store_url(url, options)


def test_store_option_pairs():
    assert parse_store_options(["protocol=tcp", "retry_s = 2"]) == {"protocol": "tcp", "retry_s": "2"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_store_options(["protocol"])
