"""Engine mode: a workload through an in-process ``LLMEngine`` (no HTTP) per engine config, one
report column each, plus a transformers ``generate`` baseline column (``driver.drive`` runs
them, on ``backends``).

A config is a dict of ``EngineConfig`` keyword arguments (``CONFIG_PRESETS``: ``off``, ``l1``,
``all``); a config naming a field this build's ``EngineConfig`` lacks is skipped with a message
(``missing_fields``), so presets can name the tier fields before they land.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from deepinfer.bench.backends import EngineBackend, TransformersBackend
from deepinfer.bench.driver import DriveOptions, DriveResult, drive
from deepinfer.bench.sessions import Workload

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
