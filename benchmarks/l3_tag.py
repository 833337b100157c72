"""Throughput of the L3 file tag: XXH3-128 (default), CRC-32 (the earlier default, still read)
and keyed BLAKE2b (--kv-store-secret).

Two measures, each side run interleaved with the others in every round (best of the rounds):
the tag alone over SmolLM2-135M page payloads (16 tokens, fp32: 737,280 bytes), and
``DiskStore.get`` of such files from the page cache (read + parse + tag check; the default and
the keyed store). Run:

    python benchmarks/l3_tag.py [--rounds 5] [--files 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer.hardware import lscpu_model
from deepinfer.kv.tiers.disk_store import DiskStore  # noqa: E402
from deepinfer.kv.tiers.disk_file import CRC32, KEYED, XXH3, PageFormat, page_id  # noqa: E402

PAGE_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, page 16, fp32


def best_gbs(fn, nbytes: int, rounds: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    rounds.append(nbytes / (time.perf_counter() - t0) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--files", type=int, default=64)
    args = ap.parse_args()
    payload = os.urandom(PAGE_BYTES)
    formats = {XXH3: PageFormat("ns"), KEYED: PageFormat("ns", b"secret")}
    algs = [XXH3, CRC32, KEYED]
    tag: dict[str, list[float]] = {name: [] for name in algs}
    get: dict[str, list[float]] = {name: [] for name in formats}
    with tempfile.TemporaryDirectory() as d:
        stores = {name: DiskStore(Path(d) / name.replace("-", "_"), 1 << 40, "ns", secret=f.secret)
                  for name, f in formats.items()}
        keys = [f"{i:032x}" for i in range(args.files)]
        for s in stores.values():
            for i, k in enumerate(keys):
                s.put(k, payload, 16, page_id(bytes(16), [i]))
        for _ in range(args.rounds):
            for alg in algs:
                fmt = formats[KEYED] if alg == KEYED else formats[XXH3]
                best_gbs(lambda: [fmt.tag(payload, alg=alg) for _ in range(args.files)],
                         PAGE_BYTES * args.files, tag[alg])
            for name, s in stores.items():
                best_gbs(lambda: [s.get(k, view=True) for k in keys], PAGE_BYTES * args.files,
                         get[name])
    print(f"CPU: {lscpu_model()}; {args.files} files of {PAGE_BYTES:,} B, best of {args.rounds} "
          "interleaved rounds, one thread")
    for alg in algs:
        g = f"   DiskStore.get {max(get[alg]):6.2f} GB/s" if alg in get else ""
        print(f"  {alg:14s} tag {max(tag[alg]):6.2f} GB/s{g}")
    print(f"  tag vs {XXH3}: {CRC32} {max(tag[CRC32]) / max(tag[XXH3]):.2f}x, "
          f"{KEYED} {max(tag[KEYED]) / max(tag[XXH3]):.2f}x; keyed get "
          f"{max(get[KEYED]) / max(get[XXH3]):.2f}x")

if __name__ == "__main__":
    main()
