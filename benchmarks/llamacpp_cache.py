"""llama.cpp's own prefix reuse on the prompts of ``ttft_cache.py`` (issue 17's comparison (c)),
and where the benchmarks find the llama.cpp peer's venv (``DEFAULT_PEER``, ``peer_python``).

llama-cpp-python keeps the KV of its current context and, with a cache set, a RAM cache of
whole context states keyed by their tokens: a prompt loads the state of its longest cached
prefix (``LlamaRAMCache``, what its server's ``--cache true`` turns on) and evaluates only the
rest. Three TTFTs on the same token ids as our cases, in one fresh process of the peer's venv:
the cold prompt (nothing cached), the same prefix with another tail after an unrelated prompt
replaced the context (the RAM cache's state load + the tail: our L2 hit's counterpart), and a
third tail right after (the prefix still in the context: our L1 hit's). Time to the first
streamed token; the cache saves each finished state after it, outside the timing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

DEFAULT_PEER = Path.home() / ".cache" / "llamacpp-peer" / "bin" / "python"
_CHILD = """
import json, sys, time
from llama_cpp import Llama, LlamaRAMCache
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)
llm.set_cache(LlamaRAMCache(capacity_bytes=8 << 30))
def ttft(ids):
    t0, first = time.perf_counter(), None
    for _ in llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True):
        first = first or time.perf_counter() - t0
    return first  # (the generator ran to its end: the cache saved the state)
base, tails = a["base"], a["tails"]
out = {"cold": ttft(base + tails[0])}
ttft(a["other"])  # the context now holds another prompt: the next hit loads from the RAM cache
out["ram_cache"] = ttft(base + tails[1])
out["context"] = ttft(base + tails[2])
print(json.dumps(out))
"""


def peer_python(arg: str) -> Path | None:
    """The peer venv's python (``--llamacpp-python``; '' skips the comparison), if it exists."""
    p = Path(arg) if arg else None
    return p if p is not None and p.exists() else None


def cache_ttfts(peer: Path, gguf: Path, base: list[int], tails: list[list[int]], other: list[int],
                threads: int) -> dict[str, float]:
    """-> seconds to the first token: ``cold``, ``ram_cache`` and ``context`` (module docstring)."""
    n_ctx = len(base) + max(len(t) for t in tails[:3]) + 64
    args = dict(gguf=str(gguf), n_ctx=n_ctx, threads=threads, base=base, tails=tails[:3], other=other)
    out = subprocess.run([str(peer), "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict]) -> str:
    """Our L1 / L2 hits next to llama.cpp's in-context / RAM-cache hits of the same prompts."""
    rows = [r for r in rows if "llamacpp" in r]
    if not rows:
        return ""
    head = ("| codec | prompt | hit | cold: ours / llama.cpp | L1 vs in-context: ours / llama.cpp | "
            "L2 vs RAM cache: ours / llama.cpp | speed-up from cache: ours L2 / llama.cpp RAM cache |")
    lines = ["llama.cpp (llama-cpp-python, the same GGUF at Q4_1; ours in the engine's dtype), the same "
             "token ids; TTFT in seconds.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["llamacpp"]
        lines.append(f"| {r['codec']} | {r['prompt_tokens']} | {r['cached_tokens'] / r['prompt_tokens']:.1%} | "
                     f"{r['cold']:.2f} / {c['cold']:.2f} | {r['l1']:.3f} / {c['context']:.3f} | "
                     f"{r['l2']:.3f} / {c['ram_cache']:.3f} | {r['cold'] / r['l2']:.1f}x / "
                     f"{c['cold'] / c['ram_cache']:.1f}x |")
    return "\n".join(lines) + "\n"
