"""Save-path cost of the lossy KV codecs (issue 17): the page encode, torch ops vs the native op
(``kv/tiers/native_pages.py``), and whole L3 saves through ``TierIO``; no model needed.

A SmolLM2-135M-shaped page (30 layers, 3 KV heads x 64, 16 tokens, fp32: 60 buffers, 184K
values). Per codec, alternating rounds in one process: ``torch``, ``page_bytes``' torch encode
(``Codec.encode_rows`` per buffer) of ``--torch-pages`` pages; ``native``, ``encode_native`` of
the same pages, whose bytes must equal the torch ones. ms per page (best of the rounds), and
their ratio. Then ``save``: ``--save-pages`` pages written to L3 through ``TierIO.device_to_disk``
(capture, encode and file writes on the L3 writer thread) until on disk, per codec, next to
lossless (no encode), in alternating rounds: what the writer threads now spend per page.

    python benchmarks/page_encode.py [--codecs fp8,fp4,mxfp4] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import deepinfer  # noqa: E402, F401  (first: sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from deepinfer.hardware import lscpu_model  # noqa: E402
from deepinfer.kv.layout import KVSpec  # noqa: E402
from deepinfer.kv.pool import PagePool  # noqa: E402
from deepinfer.kv.tiers.codec_base import Codec  # noqa: E402
from deepinfer.kv.tiers.codecs import get_codec  # noqa: E402
from deepinfer.kv.tiers.disk_file import page_id  # noqa: E402
from deepinfer.kv.tiers.native_pages import encode_native, native_encodes  # noqa: E402
from deepinfer.kv.tiers.page_bytes import PoolTransfer  # noqa: E402
from deepinfer.kv.tiers.tier_io import TierIO  # noqa: E402

PAGE = 16
SPECS = [KVSpec.gqa(3, 64) for _ in range(30)]  # SmolLM2-135M


def torch_encode(codec: Codec, data: list[torch.Tensor]) -> torch.Tensor:
    n = data[0].shape[0]
    return torch.cat([codec.encode_rows(d.reshape(n, -1)) for d in data], dim=1)


def best_ms_per_page(fn, n: int, best: float) -> float:
    t0 = time.perf_counter()
    fn()
    return min(best, (time.perf_counter() - t0) / n * 1e3)


def encode_costs(codecs: list[str], pages: int, rounds: int) -> dict[str, tuple[float, float]]:
    pool = PagePool(SPECS, pages + 1, PAGE, torch.float32, torch.device("cpu"))
    for b in pool.owned_buffers():
        b.copy_(torch.randn(b.shape))
    data = pool.read_pages(list(range(1, pages + 1)))
    out = {}
    for name in codecs:
        codec = get_codec(name, page_size=PAGE)
        assert native_encodes(codec, torch.float32), f"{name}: no native encode here"
        assert torch.equal(encode_native(codec, data), torch_encode(codec, data))
        t_best = n_best = float("inf")
        for _ in range(rounds):
            t_best = best_ms_per_page(lambda: torch_encode(codec, data), pages, t_best)
            n_best = best_ms_per_page(lambda: encode_native(codec, data), pages, n_best)
        out[name] = (t_best, n_best)
    return out


def save_costs(codecs: list[str], pages: int, rounds: int, work: Path) -> dict[str, float]:
    pool = PagePool(SPECS, pages + 1, PAGE, torch.float32, torch.device("cpu"))
    for b in pool.owned_buffers():
        b.copy_(torch.randn(b.shape))
    best = dict.fromkeys(["lossless", *codecs], float("inf"))
    for r in range(rounds):
        for name in best:
            io = TierIO(PoolTransfer(pool), PAGE, "bench", disk_dir=str(work / f"{name}{r}"),
                        disk_bytes=1 << 40, disk_codec=name)
            keys = [f"{r:08x}{i:024x}" for i in range(pages)]
            ids = [page_id(i.to_bytes(16, "little"), list(range(i, i + PAGE))) for i in range(pages)]

            def save() -> None:
                for i in range(0, pages, 32):
                    assert io.device_to_disk(list(range(1 + i, 1 + min(pages, i + 32))),
                                             keys[i : i + 32], ids[i : i + 32])
                assert io.close()  # waits for the writer: every file on disk

            best[name] = best_ms_per_page(save, pages, best[name])
            assert io.counters["disk_pages_written"] == pages
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="fp8,fp4,mxfp4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-pages", type=int, default=4)  # torch FP4 takes seconds per page
    ap.add_argument("--save-pages", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 2 / 64 pages (< 2 min quiet)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.torch_pages, args.save_pages = 2, 2, 64
    codecs = args.codecs.split(",")
    print(f"CPU: {lscpu_model()} ({os.cpu_count()} CPUs), torch {torch.get_num_threads()} threads; "
          f"SmolLM2 page (60 buffers, fp32, 738 KB); best of {args.rounds} alternating rounds", flush=True)
    for name, (t, n) in encode_costs(codecs, args.torch_pages, args.rounds).items():
        print(f"encode {name:6s} torch {t:9.2f} ms/page  native {n:6.2f} ms/page  ({t / n:.0f}x)", flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-encode-") as tmp:
        save = save_costs(codecs, args.save_pages, args.rounds, Path(tmp))
    cells = "  ".join(f"{k} {v:.2f}" for k, v in save.items())
    print(f"L3 save ({args.save_pages} pages through TierIO, native encode), ms/page: {cells}", flush=True)


if __name__ == "__main__":
    main()
