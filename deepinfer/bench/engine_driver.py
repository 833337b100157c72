"""Engine mode: drive a workload through an in-process ``LLMEngine`` (no HTTP), one report
column per engine config, plus a transformers ``generate`` baseline column.

A config is a dict of ``EngineConfig`` keyword arguments (``CONFIG_PRESETS``: ``off``, ``l1``,
``all``); a config naming a field this build's ``EngineConfig`` lacks is skipped with a message
(``missing_fields``), so presets can name the tier fields before they land.

Scheduling is the same as client mode's (``client.py``): sessions run interleaved, each one
turn at a time (turn k+1 is added only after turn k's reply, plus its think time, and never
before its ``arrival_s``). The driver adds a request to the engine when its time comes and
steps the engine in a loop; when the engine is idle and the next turn is not due, it sleeps
(``idle="sleep"``, arrival times honoured in real time) or moves its clock forward
(``idle="skip"``: gaps vanish, latencies are unchanged since they are measured from the add).
``max_in_flight`` bounds the requests in the engine at once (default: no bound; the engine's
``max_num_seqs`` batches them).

Per request (``metrics.RequestRecord``): TTFT from ``add_request`` to the first token and
the finish time, both from the engine's own clock (``Request.arrival_time``,
``first_token_time``, ``finish_time``); cached tokens and ``Request.cached_tokens_by_tier``;
completion tokens. Per config: ``engine.stats()`` (kept whole in the report's meta; numbers
whose name mentions bytes become ``bytes_by_tier``); the stats include one 16-token warm-up
request run before the clock starts (``DriveOptions.warmup``).

Chat turns are rendered with ``deepinfer.chat.render_chat`` on the whole message list each
turn (``LLM.chat`` semantics: the prompt is the template over the history, the reply text is
appended to the history). Tool calls become plain text (``workloads.to_text_messages``) when
the model's chat template has no tool support (``tool_format="auto"``). Token-prompt turns
(block traces) are sent as token ids. ``ideal_cached_tokens`` comes from the trace where it
has one, else from an infinite cache at the engine's page size over everything earlier
requests held (prompt and reply), less the last token (always computed).
"""

from __future__ import annotations

import gc
import heapq
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deepinfer.bench.metrics import RequestRecord
from deepinfer.bench.workloads import (
    ConversationState,
    Turn,
    Workload,
    to_text_messages,
)

# A preset naming a field this build's EngineConfig lacks is skipped with a message
# (``missing_fields``). ``{run_dir}`` is the results folder of the run: "all" gets an L3
# directory of its own, emptied before the config runs, so no earlier run's cache helps it.
CONFIG_PRESETS: dict[str, dict[str, Any]] = {
    "off": {"enable_prefix_cache": False},
    "l1": {"enable_prefix_cache": True, "host_cache_gb": 0.0, "enable_disk_cache": False},
    "all": {"enable_prefix_cache": True, "host_cache_gb": 1.0, "enable_disk_cache": True,
            "disk_cache_gb": 4.0, "disk_cache_dir": "{run_dir}/l3-cache"},
}


def engine_config_fields() -> set[str]:
    from deepinfer.config import EngineConfig

    return {f.name for f in fields(EngineConfig)}


def missing_fields(kwargs: Mapping[str, Any]) -> list[str]:
    """Keys of ``kwargs`` that ``EngineConfig`` does not have (in this build)."""
    known = engine_config_fields()
    return sorted(k for k in kwargs if k not in known)


def resolve_configs(names: Sequence[str], custom: Mapping[str, Mapping[str, Any]] | None = None,
                    *, run_dir: str = ".") -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Preset / custom configs by name -> (runnable {name: kwargs}, skipped {name: why})."""
    custom = dict(custom or {})
    runnable: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name in custom:
            kw = dict(custom[name])
        elif name in CONFIG_PRESETS:
            kw = dict(CONFIG_PRESETS[name])
        else:
            skipped[name] = f"unknown config (presets: {', '.join(CONFIG_PRESETS)})"
            continue
        kw = {k: (v.format(run_dir=run_dir) if isinstance(v, str) else v) for k, v in kw.items()}
        miss = missing_fields(kw)
        if miss:
            skipped[name] = (f"EngineConfig has no field(s) {', '.join(miss)} in this build "
                             "(the tiers' config fields have not landed); skipped")
            continue
        runnable[name] = kw
    return runnable, skipped


# ---------------------------------------------------------------------------------- backends
@dataclass
class Finished:
    """A request that ended, as a backend reports it (times: ``perf_counter`` seconds)."""

    request_id: str
    first_token_time: float | None
    finish_time: float
    prompt_tokens: int
    output_ids: list[int]
    text: str
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class EngineBackend:
    """An ``LLMEngine`` built from ``EngineConfig(**kwargs)``."""

    def __init__(self, engine_kwargs: Mapping[str, Any], *, temperature: float = 0.0,
                 ignore_eos: bool = True) -> None:
        from deepinfer.config import EngineConfig
        from deepinfer.engine import LLMEngine

        kw = {"progress": False, **engine_kwargs}
        self.engine = LLMEngine(EngineConfig(**kw))
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = set(self.engine.eos_token_ids)
        self.vocab_size = self.engine.hf_config.vocab_size
        self.page_size = self.engine.config.page_size
        self.max_model_len = self.engine.max_model_len
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self._reqs: dict[str, Any] = {}
        # engine.Request times are time.monotonic(); records use perf_counter()
        self._clock_shift = time.perf_counter() - time.monotonic()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        from deepinfer.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                ignore_eos=self.ignore_eos)
        self._reqs[request_id] = self.engine.add_request(prompt_ids, params, request_id=request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[Finished]:
        out = []
        for req in self.engine.step():
            if not req.is_finished:
                continue
            self._reqs.pop(req.request_id, None)
            o = self.engine.make_output(req)
            shift = self._clock_shift
            out.append(Finished(
                request_id=req.request_id,
                first_token_time=(None if req.first_token_time is None
                                  else req.first_token_time + shift),
                finish_time=(req.finish_time if req.finish_time is not None
                             else time.monotonic()) + shift,
                prompt_tokens=o.num_prompt_tokens, output_ids=list(o.token_ids), text=o.text,
                cached_tokens=o.num_cached_tokens, cached_by_tier=dict(o.cached_tokens_by_tier)))
        return out

    def arrival_time(self, request_id: str) -> float | None:
        req = self._reqs.get(request_id)
        return None if req is None else req.arrival_time + self._clock_shift

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.shutdown()  # let queued L2/L3 writes land, stop the tier threads
        self.engine = None  # type: ignore[assignment]


class _FirstTokenTimer:
    """A ``generate`` streamer that notes when the first generated token comes out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersBackend:
    """transformers ``generate`` on the same checkpoint folder: fp32, one request at a time,
    greedy, no cache kept across requests (each request prefills its whole prompt)."""

    def __init__(self, checkpoint_path: str, *, ignore_eos: bool = True,
                 eos_token_ids: Sequence[int] = (), tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint_path, dtype=torch.float32).eval()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(checkpoint_path)
        self.ignore_eos = ignore_eos
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = self.model.config.vocab_size
        self._queue: list[tuple[str, list[int], int, float]] = []

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        self._queue.append((request_id, prompt_ids, max_tokens, time.perf_counter()))

    def has_work(self) -> bool:
        return bool(self._queue)

    def arrival_time(self, request_id: str) -> float | None:
        return next((t for rid, _, _, t in self._queue if rid == request_id), None)

    def step(self) -> list[Finished]:
        rid, ids, max_tokens, _ = self._queue.pop(0)
        torch = self.torch
        timer = _FirstTokenTimer()
        x = torch.tensor([ids])
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": False,
                              "pad_token_id": self.eos_token_ids[0] if self.eos_token_ids else 0}
        if self.ignore_eos:
            kw.update(min_new_tokens=max_tokens, eos_token_id=None)
        elif self.eos_token_ids:
            kw["eos_token_id"] = self.eos_token_ids
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=timer, **kw)
        end = time.perf_counter()
        new = out[0, len(ids):].tolist()
        if not self.ignore_eos:
            cut = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
            new = new if cut is None else new[: cut + 1]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return [Finished(request_id=rid, first_token_time=timer.first or end, finish_time=end,
                         prompt_tokens=len(ids), output_ids=new, text=text,
                         cached_by_tier={})]

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.model = None


# ---------------------------------------------------------------------------------- driver
@dataclass
class DriveOptions:
    max_in_flight: int | None = None
    use_recorded_replies: bool = True
    tool_format: str = "auto"  # auto | openai | text
    idle: str = "sleep"  # sleep | skip
    max_requests: int | None = None
    max_duration_s: float | None = None  # no request added after this (run clock)
    progress: bool = True
    label: str = ""
    warmup: bool = True  # one short request first, not recorded (one-time costs off the clock)


@dataclass
class DriveResult:
    records: list[RequestRecord]
    duration_s: float | None  # None: first arrival -> last finish of the records
    stats: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)


def _template_has_tools(tokenizer: Any) -> bool:
    t = getattr(tokenizer, "chat_template", None) or ""
    return "tool" in t if isinstance(t, str) else True


class _IdealTracker:
    """Infinite cache at the engine's page size over what earlier requests held."""

    def __init__(self, page_size: int) -> None:
        from deepinfer.bench.ideal import IdealIndex

        self.ps = page_size
        self.idx = IdealIndex()

    def lookup(self, prompt: list[int]) -> int:
        from deepinfer.bench.ideal import token_block_ids

        hit = self.idx.lookup_insert("", token_block_ids(prompt, self.ps), self.ps, len(prompt))
        return min(hit // self.ps, (len(prompt) - 1) // self.ps) * self.ps

    def add(self, tokens: list[int]) -> None:
        from deepinfer.bench.ideal import token_block_ids

        self.idx.lookup_insert("", token_block_ids(tokens, self.ps), self.ps, len(tokens))


@dataclass(order=True)
class _Due:
    ready_at: float
    order: int
    session: int = field(compare=False)


def drive(backend: Any, workload: Workload, opts: DriveOptions | None = None,
          *, page_size: int | None = None) -> DriveResult:
    """Run every session of ``workload`` on ``backend`` (module doc); records in finish order."""
    from tqdm import tqdm

    from deepinfer.chat import render_chat
    from deepinfer.errors import RequestError

    opts = opts or DriveOptions()
    if opts.idle not in ("sleep", "skip"):
        raise ValueError("idle must be 'sleep' or 'skip'")
    tok = backend.tokenizer
    text_tools = (opts.tool_format == "text"
                  or (opts.tool_format == "auto" and not _template_has_tools(tok)))
    ideal = _IdealTracker(page_size) if page_size else None
    sessions = workload.sessions
    states = [ConversationState(s, use_recorded_replies=opts.use_recorded_replies)
              for s in sessions]
    next_turn = [0] * len(sessions)
    total = workload.num_requests
    if opts.max_requests is not None:
        total = min(total, opts.max_requests)
    t0 = 0.0  # set when the clock starts, after the warm-up
    skipped_s = 0.0

    def now() -> float:
        return time.perf_counter() - t0 + skipped_s

    if opts.warmup:
        backend.submit("warmup", [(7 * k + 11) % backend.vocab_size for k in range(16)], 2)
        while backend.has_work():
            backend.step()
    heap: list[_Due] = []
    order = 0
    bar = tqdm(total=total, desc=f"engine {opts.label or workload.name}", unit="req",
               disable=not opts.progress)
    t0 = time.perf_counter()

    def schedule(i: int, after: float) -> None:
        nonlocal order
        k = next_turn[i]
        if k >= len(sessions[i].turns):
            return
        turn = sessions[i].turns[k]
        ready = after + (turn.think_time_s if k > 0 else 0.0)
        if turn.arrival_s is not None:
            ready = max(ready, turn.arrival_s)
        if opts.max_duration_s is not None and ready >= opts.max_duration_s:
            return
        order += 1
        heapq.heappush(heap, _Due(ready, order, i))

    for i in range(len(sessions)):
        schedule(i, 0.0)
    records: list[RequestRecord] = []
    inflight: dict[str, tuple[int, Turn, RequestRecord, list[int]]] = {}
    issued = 0
    notes: dict[str, Any] = {"template_fallbacks": 0, "text_tools": text_tools}
    try:
        while True:
            t = now()
            while (heap and heap[0].ready_at <= t
                   and (opts.max_in_flight is None or len(inflight) < opts.max_in_flight)
                   and (opts.max_requests is None or issued < opts.max_requests)):
                i = heapq.heappop(heap).session
                turn = sessions[i].turns[next_turn[i]]
                next_turn[i] += 1
                issued += 1
                rec = RequestRecord(
                    request_id=turn.request_id or f"{sessions[i].session_id}-{next_turn[i]}",
                    session_id=sessions[i].session_id, arrival_s=now(), first_token_s=None,
                    finish_s=None, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                    ideal_cached_tokens=turn.ideal_cached_tokens)
                try:
                    ids = turn.tokens()
                    if ids is None:
                        msgs = states[i].request_messages(turn)
                        if text_tools:
                            msgs = to_text_messages(msgs)
                        try:
                            ids = render_chat(tok, msgs)
                        except Exception:  # noqa: BLE001 - a template without tool support
                            notes["template_fallbacks"] += 1
                            ids = render_chat(tok, to_text_messages(msgs))
                    rec.prompt_tokens = len(ids)
                    if ideal is not None and rec.ideal_cached_tokens is None:
                        rec.ideal_cached_tokens = ideal.lookup(ids)
                    rec.arrival_s = now()
                    backend.submit(rec.request_id, ids, turn.max_tokens)
                except (RequestError, ValueError) as e:
                    rec.error = f"{type(e).__name__}: {e}"[:500]
                    records.append(rec)
                    bar.update(1)
                    continue  # the session's history is broken: stop it
                arrived = backend.arrival_time(rec.request_id)
                if arrived is not None:  # the backend's own add time, on the run clock
                    rec.arrival_s = arrived - t0 + skipped_s
                inflight[rec.request_id] = (i, turn, rec, ids)
            if backend.has_work():
                for f in backend.step():
                    i, turn, rec, ids = inflight.pop(f.request_id)
                    base = skipped_s - t0
                    rec.first_token_s = (None if f.first_token_time is None
                                         else f.first_token_time + base)
                    rec.finish_s = f.finish_time + base
                    rec.completion_tokens = len(f.output_ids)
                    rec.cached_tokens = f.cached_tokens
                    rec.cached_by_tier = dict(f.cached_by_tier)
                    rec.prompt_tokens = f.prompt_tokens
                    rec.error = f.error
                    records.append(rec)
                    bar.update(1)
                    if ideal is not None:
                        ideal.add(ids + f.output_ids)
                    states[i].add_reply(turn, f.text)
                    schedule(i, rec.finish_s)
                continue
            if not heap or (opts.max_requests is not None and issued >= opts.max_requests):
                break
            wait = heap[0].ready_at - now()
            if wait > 0:
                if opts.idle == "skip":
                    skipped_s += wait
                else:
                    time.sleep(min(wait, 1.0))
    finally:
        bar.close()
    ok = [r for r in records if r.ok]
    duration = (max(r.finish_s for r in ok) - min(r.arrival_s for r in ok)) if ok else 0.0  # type: ignore[type-var]
    notes["idle_skipped_s"] = skipped_s
    return DriveResult(records=records, duration_s=duration, stats=backend.stats(), notes=notes)


# ---------------------------------------------------------------------------------- stats
def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_TIER_WORDS = ("device", "host", "disk", "l1", "l2", "l3")


def bytes_by_tier(stats: Mapping[str, Any]) -> dict[str, int] | None:
    """Bytes moved (read / written / moved) in ``engine.stats()``, keyed by the tier (or
    direction, e.g. ``device->host``) their name gives; None if there are none."""
    out: dict[str, int] = {}
    for key, v in _flatten(stats).items():
        low = key.lower()
        if "bytes" not in low or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not any(w in low for w in ("read", "writ", "moved", "->")):
            continue  # a size (bytes held, pending), not bytes moved
        parts = [p for p in key.replace("/", ".").split(".")]
        label = next((p for p in reversed(parts)
                      if "->" in p or p.lower() in _TIER_WORDS), None)
        if label is None:
            label = next((w for w in _TIER_WORDS if w in key.lower()), key)
        low = key.lower()
        if "->" not in label:
            if "read" in low:
                label += " read"
            elif "writ" in low:
                label += " written"
        out[label] = out.get(label, 0) + int(v)
    return out or None


# ---------------------------------------------------------------------------------- runs
@dataclass
class BenchRun:
    results: dict[str, DriveResult]
    skipped: dict[str, str]
    engine_args: dict[str, Any]
    checkpoint_path: str | None = None
    workload: Workload | None = None  # as run (built with the model's vocabulary)


def run_engine_bench(
    workload_factory: Callable[[int], Workload] | Workload,
    configs: Mapping[str, Mapping[str, Any]],
    *,
    engine_args: Mapping[str, Any] | None = None,
    baseline: str | None = None,
    skipped: Mapping[str, str] | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    opts: DriveOptions | None = None,
    log: Callable[[str], None] = print,
    run_dir: str | Path | None = None,
    rounds: int = 1,
) -> BenchRun:
    """Run the workload once per config (a fresh engine each) and once on the baseline.

    ``workload_factory(vocab_size)`` builds the workload once the model's vocabulary is known
    (token-prompt traces need it); a ``Workload`` is used as is. ``baseline``: None or
    ``"transformers"``. A config's ``disk_cache_dir`` inside ``run_dir`` is emptied before
    each run of the config (an L3 cache of its own, cold at the start). ``rounds > 1`` runs
    every column that many times, interleaved (all columns, then all again: a load spike on a
    shared machine hits every column alike), and keeps each column's median-duration run;
    all durations are in the run's ``notes["durations_s"]``.
    """
    from deepinfer.config import EngineConfig

    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    opts = opts or DriveOptions()
    base = dict(engine_args or {})
    runs: dict[str, list[DriveResult]] = {}
    skipped = dict(skipped or {})
    for name, why in skipped.items():
        log(f"config {name!r}: {why}")
    if baseline and baseline != "transformers":
        raise ValueError(f"unknown baseline {baseline!r} (known: transformers)")
    workload: Workload | None = workload_factory if isinstance(workload_factory, Workload) else None
    ckpt_path: str | None = None
    tokenizer = eos = None
    for _ in range(rounds):
        for name, kw in configs.items():
            disk = kw.get("disk_cache_dir")
            if disk and run_dir is not None and _inside(Path(disk), Path(run_dir)):
                shutil.rmtree(disk, ignore_errors=True)
            backend = EngineBackend({**base, **kw}, temperature=temperature,
                                    ignore_eos=ignore_eos)
            ckpt_path = str(backend.engine.checkpoint_path)
            tokenizer, eos = backend.tokenizer, sorted(backend.eos_token_ids)
            if workload is None:
                workload = workload_factory(backend.vocab_size)  # type: ignore[operator]
            o = DriveOptions(**{**opts.__dict__, "label": name})
            runs.setdefault(name, []).append(
                drive(backend, workload, o, page_size=backend.page_size))
            backend.close()
            del backend
            gc.collect()
        if baseline:
            if ckpt_path is None:
                from deepinfer.loader import load_checkpoint

                ck = load_checkpoint(base.get("model"), progress=False)
                ckpt_path, tokenizer, eos = str(ck.path), ck.tokenizer, list(ck.eos_token_ids)
            hf = TransformersBackend(ckpt_path, ignore_eos=ignore_eos, eos_token_ids=eos or (),
                                     tokenizer=tokenizer)
            if workload is None:
                workload = workload_factory(hf.vocab_size)  # type: ignore[operator]
            o = DriveOptions(**{**opts.__dict__, "label": baseline})
            page = int(base.get("page_size",
                                EngineConfig.__dataclass_fields__["page_size"].default))
            runs.setdefault(baseline, []).append(drive(hf, workload, o, page_size=page))
            hf.close()
            del hf
            gc.collect()
    results: dict[str, DriveResult] = {}
    for name, rs in runs.items():
        pick = sorted(rs, key=lambda r: r.duration_s or 0.0)[(len(rs) - 1) // 2]
        if len(rs) > 1:
            pick.notes["durations_s"] = [r.duration_s for r in rs]
        results[name] = pick
    return BenchRun(results=results, skipped=skipped, engine_args=base, checkpoint_path=ckpt_path,
                    workload=workload)


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return path.resolve() != folder.resolve()


def write_engine_report(run_dir: Any, run: BenchRun, *, meta: Mapping[str, Any] | None = None,
                        baseline_column: str | None = None) -> dict[str, Any]:
    """``report.write_report`` over the run's columns, engine stats and notes in the meta."""
    from deepinfer.bench.report import write_report

    m: dict[str, Any] = dict(meta or {})
    m["engine args"] = run.engine_args
    for name, why in run.skipped.items():
        m[f"skipped {name}"] = why
    for name, r in run.results.items():
        if r.stats:
            m[f"engine stats {name}"] = r.stats
        if r.notes.get("template_fallbacks"):
            m[f"template fallbacks {name}"] = r.notes["template_fallbacks"]
        if r.notes.get("durations_s"):
            m[f"durations of the rounds {name} (s)"] = [round(d or 0.0, 2)
                                                        for d in r.notes["durations_s"]]
    return write_report(
        run_dir, {n: r.records for n, r in run.results.items()}, meta=m,
        bytes_by_tier={n: b for n, r in run.results.items() if (b := bytes_by_tier(r.stats))},
        duration_s={n: r.duration_s for n, r in run.results.items() if r.duration_s is not None},
        baseline=baseline_column if baseline_column in run.results else None)


def default_baseline_column(names: Sequence[str]) -> str | None:
    """The column speed-ups are relative to: ``off`` if it ran, else the first."""
    if "off" in names:
        return "off"
    return names[0] if names else None

