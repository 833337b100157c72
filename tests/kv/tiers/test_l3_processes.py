"""One L3 directory across processes: restart and concurrent writers sharing it (the same
greedy output from what either wrote), and kill -9 during heavy writing leaves only valid files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tier_engine_helpers import GREEDY, PS, make, prompts

from deepinfer.kv.tiers.disk_store import DiskStore

REPO = Path(__file__).resolve().parents[3]

_WORKER = textwrap.dedent("""
    import json, sys
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    ckpt, disk, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    llm = LLM(ckpt, page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False,
              disk_cache_dir=disk)
    res = []
    for p in prompts:
        o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        res.append({"tokens": o.token_ids, "by_tier": o.cached_tokens_by_tier})
    assert llm.engine.shutdown()
    json.dump(res, open(out, "w"))
""")

_HEAVY_WRITER = textwrap.dedent("""
    import sys, torch
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    llm = LLM(sys.argv[1], page_size=4, num_pages=2048, max_num_batched_tokens=2048, progress=False,
              disk_cache_dir=sys.argv[2], host_cache_gb=0)
    g = torch.Generator().manual_seed(0)
    while True:
        ps = [torch.randint(3, 300, (200,), generator=g).tolist() for _ in range(8)]
        llm.generate(ps, SamplingParams(max_tokens=1))
""")


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _spawn(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out


def test_restart_and_processes_sharing_one_l3_dir(tiny_llama, reference, tmp_path):
    """Processes A and C write concurrently (with a common prefix: the same files, raced);
    then this process, B, with an empty tree, hits from L3 everything either wrote, and its
    greedy output is theirs."""
    p1, p3 = prompts(2, 161, seed=40, shared=100)
    disk = tmp_path / "l3"
    a = _spawn(_WORKER, tiny_llama, disk, json.dumps([p1]), tmp_path / "a.json")
    c = _spawn(_WORKER, tiny_llama, disk, json.dumps([p3]), tmp_path / "c.json")
    _finish(a)
    _finish(c)
    ra, rc = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ac")
    # A and C race on the shared prefix: A may hit (a whole-page prefix of) what C wrote so far
    hit = ra[0]["by_tier"]["disk"]
    assert ra[0]["by_tier"]["device"] == 0 and hit % PS == 0 and hit <= 100
    b = make(tiny_llama, disk)
    ob = b.generate(p1, GREEDY)[0]
    assert ob.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 160} and 160 >= len(p1) - PS
    b.engine.kv.evict()
    b.engine.kv.evict(1)  # L1 and L2 emptied: only L3 is left
    ob3 = b.generate(p3, GREEDY)[0]
    assert ob3.cached_tokens_by_tier["disk"] == 160
    assert ra[0]["tokens"] == ob.token_ids == reference([p1])[0]
    assert rc[0]["tokens"] == ob3.token_ids == reference([p3])[0]
    b.engine.shutdown()
    assert DiskStore(disk, 1 << 40, None).verify()["corrupt"] == 0


def test_kill_9_during_heavy_writing_leaves_only_valid_files(tiny_llama, tmp_path):
    proc = _spawn(_HEAVY_WRITER, tiny_llama, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while (len(list(tmp_path.glob("??/*.kv"))) < 300 and time.monotonic() < deadline
               and proc.poll() is None):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out
    report = DiskStore(tmp_path, 1 << 40, None).verify()
    assert report["checked"] >= 300 and report["ok"] == report["checked"], report

