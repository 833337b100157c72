"""L2 host store: slot allocation, capacity, byte and tensor writes, codec pages end to end."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.tiers.codecs import get_codec
from deepinfer.kv.tiers.host_store import HostStore


def test_capacity_and_alloc_free() -> None:
    h = HostStore(capacity_bytes=1000, slot_nbytes=300)
    assert h.num_slots == 3 and h.num_free == 3 and h.capacity_bytes == 900
    slots = [h.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and h.num_free == 0
    assert h.alloc() is None and h.stats()["alloc_failures"] == 1
    h.free(slots[1])
    assert h.num_free == 1 and h.alloc() == slots[1]
    st = h.stats()
    assert st["used"] == 3 and st["used_bytes"] == 900 and st["allocs"] == 4 and st["frees"] == 1


def test_invalid_and_double_free() -> None:
    h = HostStore(1000, 100)
    s = h.alloc()
    h.free(s)
    with pytest.raises(ValueError):
        h.free(s)
    with pytest.raises(ValueError):
        h.free(99)
    with pytest.raises(ValueError):
        h.read(s)
    with pytest.raises(ValueError):
        HostStore(1000, 0)


def test_write_read_bytes_and_tensor() -> None:
    h = HostStore(4096, 1024)
    a, b = h.alloc(), h.alloc()
    h.write(a, bytes(range(256)) * 4)
    t = torch.arange(100, dtype=torch.uint8)
    h.write(b, t)
    assert bytes(h.read(a).numpy()) == bytes(range(256)) * 4
    assert torch.equal(h.read(b), t)  # length recorded per slot
    assert h.read(b).dtype == torch.uint8 and h.read(b).data_ptr() == h.read(b).data_ptr()  # a view
    h.write(b, bytearray(b"\x07" * 10))
    assert h.read(b).tolist() == [7] * 10
    with pytest.raises(ValueError):
        h.write(a, bytes(1025))
    with pytest.raises(ValueError):
        h.write(a, torch.zeros(4, dtype=torch.float32))
    assert h.stats()["bytes_written"] == 1024 + 100 + 10


def test_zero_capacity() -> None:
    h = HostStore(10, 100)
    assert h.num_slots == 0 and h.alloc() is None


def test_pinned_only_with_cuda() -> None:
    h = HostStore(1024, 256, pin_memory=True)
    assert h.pinned == torch.cuda.is_available()
    assert h.stats()["pinned"] == h.pinned


@pytest.mark.parametrize("codec", ["lossless", "fp8", "fp4", "mxfp4"])
def test_codec_pages_in_slots(codec: str) -> None:
    c = get_codec(codec)
    shape, dtype = (16, 2, 64), torch.bfloat16
    h = HostStore(capacity_bytes=8 * c.encoded_nbytes(shape, dtype), slot_nbytes=c.encoded_nbytes(shape, dtype))
    assert h.num_slots == 8
    pages = [torch.randn(shape).to(dtype) for _ in range(8)]
    slots = []
    for p in pages:
        s = h.alloc()
        h.write(s, c.encode_to_tensor(p))
        slots.append(s)
    for p, s in zip(pages, slots):
        back = c.decode_from_tensor(h.read(s), shape, dtype)
        assert torch.equal(back, c.decode(c.encode(p), shape, dtype))
