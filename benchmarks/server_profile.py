"""Where the streamed server path spends its time, from a py-spy profile of
``benchmarks/server_overhead.py``:

    py-spy record --threads --format raw --rate 200 -o /tmp/raw.txt -- \\
        python benchmarks/server_overhead.py --rounds 2 --new-tokens 48 --threads 2
    python benchmarks/server_profile.py /tmp/raw.txt

Prints, for the engine thread while it serves streams (``AsyncEngine._step``), the samples
inside ``LLMEngine.step`` and those outside it by server function (detokenization, the hand-off
to the event loop, ...), and the event loop thread's busy samples (not waiting in ``select``)
by server function (SSE framing, the ASGI send). Shares, not times: the sampler is the same
for all of them.
"""

from __future__ import annotations

import argparse
import collections
import subprocess


def server_frame(frames: list[str], start: int) -> str:
    """The innermost ``deepinfer/server`` frame at or after ``start`` (the caller's name)."""
    hits = [f for f in frames[start:] if "deepinfer/server" in f]
    return hits[-1].split(" (")[0] if hits else frames[-1].split(" (")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy --format raw output (collapsed stacks with --threads)")
    args = ap.parse_args()
    engine, loop = collections.Counter(), collections.Counter()
    for line in open(args.raw, encoding="utf-8"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames, n = stack.split(";"), int(n)
        if "deepinfer-engine" in frames[0]:
            at = next((i for i, f in enumerate(frames) if "AsyncEngine._step" in f), None)
            if at is None:
                continue  # the engine thread running a command (e.g. the offline rounds)
            inside = any(f.startswith("step (deepinfer/engine.py") for f in frames[at + 1:]) or \
                any("StepClock.step" in f for f in frames[at + 1:])
            engine["LLMEngine.step" if inside else server_frame(frames, at)] += n
        elif "deepinfer-http" in frames[0] and not any("select (selectors.py" in f
                                                       for f in frames):
            loop[server_frame(frames, 0)] += n
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("Model name")), "unknown")
    total = sum(engine.values()) or 1
    print(f"CPU: {model}")
    print(f"engine thread serving streams: {total} samples")
    for name, n in engine.most_common(10):
        print(f"  {n / total:7.2%}  {name}")
    print(f"event loop thread, busy: {sum(loop.values())} samples")
    for name, n in loop.most_common(10):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main()
