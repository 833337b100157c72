"""Block-hash request traces: one ``TraceRequest`` list for every trace format we replay.

A trace request is what both the benchmark (token replay) and the capacity planner (no model)
need: when it arrives, which session it belongs to, the chained block ids of its prompt, the
block size, and its input/output lengths. Block ``i`` covers prompt tokens
``[i * block_size, min((i + 1) * block_size, input_length))``; the last block may be partial.
Prompt tokens past ``len(block_ids) * block_size`` (kv-cache-tester hashes full blocks only)
are unique to the request and never hit.

Block ids are only meaningful inside their ``namespace`` (one per file: Mooncake ids are global
within a file, kv-cache-tester ids are "local" to one session file), so every consumer keys
blocks by ``(namespace, chain of ids)`` and two files never collide.

Formats (see ``/work/shared/traces/README.md``):

* Mooncake JSONL: ``{timestamp (ms), input_length, output_length, hash_ids}``, 512-token blocks.
* Derived ``*_blk<N>.jsonl``: Mooncake format plus ``session_id`` and ``turn``, N-token blocks.
* kv-cache-tester JSON (one Claude Code session per file): ``block_size``, ``hash_id_scope``,
  ``requests[] {t (s), type, model, in, out, hash_ids, requests[] (sub-agents, t relative to
  the sub-agent's start)}``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_SIZE = 512
KVTESTER_BLOCK_SIZE = 64


@dataclass(slots=True)
class TraceRequest:
    """One request of a block-hash trace (times in seconds from the trace start)."""

    arrival_s: float
    session_id: str | None
    block_ids: list[int]
    block_size: int
    input_length: int
    output_length: int
    namespace: str = ""
    request_id: str = ""
    turn: int | None = None
    model: str | None = None
    prefix_tokens: list[int] | None = None  # real prompt tokens, when a trace carries them
    text: str | None = None  # real prompt text, when a trace carries it

    def block_token_counts(self) -> list[int]:
        """Prompt tokens covered by each block (the last one may be partial)."""
        bs, n = self.block_size, self.input_length
        return [max(0, min(bs, n - i * bs)) for i in range(len(self.block_ids))]

    @property
    def hashed_tokens(self) -> int:
        """Prompt tokens covered by ``block_ids`` (the rest is a unique tail)."""
        return min(self.input_length, len(self.block_ids) * self.block_size)


# ---------------------------------------------------------------------------------- paths
def default_traces_dir() -> Path | None:
    """``$DEEPINFER_TRACES``, else ``<repo>/../shared/traces``; None if neither exists."""
    env = os.environ.get("DEEPINFER_TRACES")
    cands = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    cands.append(repo.parent / "shared" / "traces")
    for c in cands:
        if c.is_dir():
            return c
    return None


# ---------------------------------------------------------------------------------- loaders
def load_mooncake(
    path: str | Path,
    *,
    block_size: int | None = None,
    namespace: str | None = None,
    max_requests: int | None = None,
) -> list[TraceRequest]:
    """Mooncake JSONL or a derived ``*_blk<N>.jsonl`` (adds ``session_id``/``turn``).

    ``block_size`` defaults to N from a ``blk<N>`` in the file name, else 512.
    ``max_requests`` reads only the first records of the file.
    """
    path = Path(path)
    if block_size is None:
        block_size = _block_size_from_name(path.name) or MOONCAKE_BLOCK_SIZE
    ns = namespace if namespace is not None else path.stem
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(out) >= max_requests:
                break
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            sid = r.get("session_id")
            out.append(
                TraceRequest(
                    arrival_s=float(r.get("timestamp", 0)) / 1000.0,
                    session_id=None if sid is None else str(sid),
                    block_ids=[int(h) for h in r["hash_ids"]],
                    block_size=block_size,
                    input_length=int(r["input_length"]),
                    output_length=int(r.get("output_length", 0)),
                    namespace=ns,
                    request_id=f"{ns}:{len(out)}",
                    turn=r.get("turn"),
                )
            )
    return _sorted(out)


def load_kvtester_file(
    path: str | Path, *, namespace: str | None = None, start_s: float = 0.0
) -> list[TraceRequest]:
    """One kv-cache-tester session file; sub-agent requests flattened in time order.

    The namespace is the file's ``id`` (else its stem): ``hash_id_scope`` "local" means ids
    of two files are unrelated. A sub-agent's requests get session ``<id>/<agent_id>`` and
    arrive at the sub-agent's start plus their own ``t``.
    """
    path = Path(path)
    d = json.loads(path.read_text())
    ns = namespace if namespace is not None else str(d.get("id") or path.stem)
    if d.get("hash_id_scope", "local") != "local":
        ns = namespace if namespace is not None else "kvtester-global"
    bs = int(d.get("block_size", KVTESTER_BLOCK_SIZE))
    out: list[TraceRequest] = []

    def walk(reqs: Sequence[dict], t0: float, session: str) -> None:
        for k, r in enumerate(reqs):
            t = t0 + float(r.get("t", 0.0))
            if "hash_ids" in r and "in" in r:
                out.append(
                    TraceRequest(
                        arrival_s=t,
                        session_id=session,
                        block_ids=[int(h) for h in r["hash_ids"]],
                        block_size=bs,
                        input_length=int(r["in"]),
                        output_length=int(r.get("out", 0)),
                        namespace=ns,
                        model=r.get("model"),
                    )
                )
            subs = r.get("requests")
            if subs:
                walk(subs, t, f"{session}/{r.get('agent_id', f'sub{k}')}")

    walk(d.get("requests", []), start_s, ns)
    out = _sorted(out)
    turns: dict[str | None, int] = {}
    for i, r in enumerate(out):
        r.request_id = f"{ns}:{i}"
        turns[r.session_id] = r.turn = turns.get(r.session_id, 0) + 1
    return out


def load_kvtester_dir(
    path: str | Path, *, max_files: int | None = None, session_stagger_s: float = 0.0
) -> list[TraceRequest]:
    """All ``*.json`` session files of a kv-cache-tester folder (name order), merged by time.

    Every session starts at 0 unless ``session_stagger_s`` offsets file k by k times it.
    """
    files = sorted(Path(path).glob("*.json"))[:max_files]
    out: list[TraceRequest] = []
    for k, f in enumerate(files):
        out.extend(load_kvtester_file(f, start_s=k * session_stagger_s))
    return _sorted(out)


def load_trace(
    path: str | Path,
    *,
    fmt: str | None = None,
    block_size: int | None = None,
    max_requests: int | None = None,
    **scale: Any,
) -> list[TraceRequest]:
    """Load any supported trace and apply ``scale_trace(**scale)``.

    ``fmt``: "mooncake" (also derived JSONL), "kvtester" (file or folder); guessed when None.
    """
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        reqs = load_mooncake(path, block_size=block_size, max_requests=max_requests)
    elif fmt == "kvtester":
        reqs = load_kvtester_dir(path) if path.is_dir() else load_kvtester_file(path)
        if max_requests is not None:
            reqs = reqs[:max_requests]
    else:
        raise ValueError(f"unknown trace format {fmt!r} for {path}")
    return scale_trace(reqs, **scale) if scale else reqs


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if path.is_dir():
        return "kvtester"
    if path.suffix == ".jsonl":
        return "mooncake"
    if path.suffix == ".json":
        with open(path) as f:
            head = f.read(4096)
        if '"block_size"' in head or '"hash_id_scope"' in head:
            return "kvtester"
    raise ValueError(f"cannot tell the trace format of {path}")


# ---------------------------------------------------------------------------------- scaling
def scale_trace(
    requests: Iterable[TraceRequest],
    *,
    token_scale: float = 1.0,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    time_compression: float = 1.0,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
) -> list[TraceRequest]:
    """Shrink a trace so a CPU run finishes in minutes, keeping its reuse structure.

    * ``token_scale`` multiplies the block size (rounded, at least 1) and every length: full
      blocks stay full, a partial last block stays partial (at least 1 token), so the block
      structure, and with it the ideal hit rate, is kept (up to rounding of partial blocks).
    * ``max_input_tokens`` keeps only the first tokens (and blocks) of longer prompts.
    * ``max_output_tokens`` caps output lengths (after scaling; at least 1).
    * ``time_compression`` divides arrival times (2.0 = twice as fast; ``inf`` = all at 0).
    * ``max_requests`` / ``max_duration_s`` keep the first requests (by original arrival).
    """
    if token_scale <= 0 or time_compression <= 0:
        raise ValueError("token_scale and time_compression must be > 0")
    out: list[TraceRequest] = []
    for r in requests:
        if max_requests is not None and len(out) >= max_requests:
            break
        if max_duration_s is not None and r.arrival_s > max_duration_s:
            continue
        bs = r.block_size
        ids = list(r.block_ids)
        if token_scale != 1.0:
            nbs = max(1, round(bs * token_scale))
            nfull = min(len(ids), r.input_length // bs)
            length = nfull * nbs
            if len(ids) > nfull:  # hashed partial last block
                ids = ids[: nfull + 1]
                part = r.input_length - nfull * bs
                length += min(nbs, max(1, math.ceil(part * token_scale)))
            else:  # unhashed tail
                tail = r.input_length - nfull * bs
                length += math.ceil(tail * token_scale) if tail > 0 else 0
            out_len = max(1, round(r.output_length * token_scale)) if r.output_length else 0
            bs = nbs
        else:
            length, out_len = r.input_length, r.output_length
        if max_input_tokens is not None and length > max_input_tokens:
            length = max_input_tokens
            ids = ids[: math.ceil(length / bs)]
        if max_output_tokens is not None:
            out_len = min(out_len, max_output_tokens)
        arrival = 0.0 if math.isinf(time_compression) else r.arrival_s / time_compression
        prefix = r.prefix_tokens[:length] if r.prefix_tokens is not None else None
        out.append(
            replace(
                r,
                arrival_s=arrival,
                block_ids=ids,
                block_size=bs,
                input_length=length,
                output_length=out_len,
                prefix_tokens=prefix,
            )
        )
    return out


# ---------------------------------------------------------------------------------- summary
@dataclass
class TraceStats:
    num_requests: int
    num_sessions: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    block_sizes: list[int] = field(default_factory=list)


def trace_stats(requests: Sequence[TraceRequest]) -> TraceStats:
    return TraceStats(
        num_requests=len(requests),
        num_sessions=len({r.session_id for r in requests if r.session_id is not None}),
        input_tokens=sum(r.input_length for r in requests),
        output_tokens=sum(r.output_length for r in requests),
        duration_s=(max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests))
        if requests
        else 0.0,
        block_sizes=sorted({r.block_size for r in requests}),
    )


def _block_size_from_name(name: str) -> int | None:
    m = re.search(r"blk(\d+)", name)
    return int(m.group(1)) if m else None


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    return sorted(reqs, key=lambda r: r.arrival_s)  # stable: file order among equal times
