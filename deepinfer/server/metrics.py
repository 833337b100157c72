"""Prometheus text exposition (format 0.0.4), written by hand: no client library needed.

Names follow vLLM where vLLM has the metric (``vllm:X`` -> ``deepinfer:X``, same meaning):
``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` count prompt *tokens* looked up /
served from the cache; ``num_requests_running`` / ``num_requests_waiting`` are gauges;
``time_to_first_token_seconds``, ``time_per_output_token_seconds`` and
``e2e_request_latency_seconds`` are histograms.

Every numeric field of ``LLMEngine.stats()`` is exported: known fields under the names in
``ENGINE_FIELDS``; any other number as ``deepinfer:<field>`` (``deepinfer:engine_<field>`` if
that name is taken), a counter when the field ends in ``_total``, else a gauge; a dict of
numbers (e.g. per-tier counts) as one series per key, labelled ``tier`` when the field name
mentions tiers, ``source`` for speculative decoding's (``spec_*``), else ``key``.
"""

from __future__ import annotations

import bisect
import copy
import math
import re
from dataclasses import dataclass, field

PREFIX = "deepinfer:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0,
                16.0, 32.0)
GBPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() field -> (metric name without prefix, type, help)
ENGINE_FIELDS = {
    "prefix_cache_queries": ("prefix_cache_queries_total", "counter",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits_total", "counter",
                          "Prompt tokens served from the prefix cache (any tier)."),
    "computed_prompt_tokens": ("prompt_tokens_computed_total", "counter",
                               "Prompt tokens prefilled (the samples of n > 1 share one prefill)."),
    "evicted_pages": ("kv_evicted_pages_total", "counter", "KV pages evicted from the device."),
    "preemptions": ("num_preemptions_total", "counter", "Requests preempted for lack of pages."),
    "free_pages": ("kv_free_pages", "gauge", "Device KV pages neither in use nor cached."),
    "total_pages": ("kv_total_pages", "gauge", "Device KV pages in the pool."),
    "running": ("num_requests_running", "gauge", "Requests being computed."),
    "waiting": ("num_requests_waiting", "gauge", "Requests waiting for a running slot or pages."),
    "compute_threads": ("compute_threads", "gauge",
                        "Compute threads now: --threads, fewer where other processes take cores."),
    "other_processes_cores": ("other_processes_cores", "gauge",
                              "Cores other processes took on this process's cores (last sample)."),
    "cache_hit_tokens_by_tier": ("prefix_cache_hits_by_tier_total", "counter",
                                 "Prompt tokens served from the prefix cache, by the tier they "
                                 "came from."),
    "cache_evicted_pages_by_tier": ("kv_evicted_pages_by_tier_total", "counter",
                                    "KV pages evicted, by tier."),
    "cache_bytes_read_by_tier": ("kv_tier_bytes_read_total", "counter",
                                 "Bytes read from a lower KV tier."),
    "cache_bytes_written_by_tier": ("kv_tier_bytes_written_total", "counter",
                                    "Bytes written to a lower KV tier."),
    "cache_pages_by_tier": ("kv_cached_pages", "gauge", "KV pages held, by tier."),
    "cache_capacity_pages_by_tier": ("kv_capacity_pages", "gauge", "KV page capacity, by tier."),
    "cache_load_bytes_by_tier": ("kv_load_bytes_by_tier_total", "counter",
                                 "Bytes of KV loaded into the device for prefix hits, by tier."),
    "cache_load_read_seconds_by_tier": ("kv_load_read_seconds_by_tier_total", "counter",
                                        "Seconds loaders spent reading and decoding prefix-hit "
                                        "KV, by tier."),
    "spec_drafted_tokens_total": ("spec_drafted_tokens_total", "counter",
                                  "Speculative draft tokens proposed, by draft source."),
    "spec_verified_tokens_total": ("spec_verified_tokens_total", "counter",
                                   "Draft tokens put in a verify span, by draft source."),
    "spec_accepted_tokens_total": ("spec_accepted_tokens_total", "counter",
                                   "Verified draft tokens the target model accepted, by source."),
    "spec_verify_steps_total": ("spec_verify_steps_total", "counter",
                                "Request-steps that verified at least one draft token, by source."),
    "spec_mean_accepted_tokens": ("spec_mean_accepted_tokens", "gauge",
                                  "Mean accepted draft tokens per verify step, by source."),
    "spec_calibration_ece": ("spec_calibration_ece", "gauge",
                             "Expected calibration error of the confidence estimates over the "
                             "rolling window, by source."),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def copy(self) -> Histogram:
        h = Histogram(self.buckets)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h


@dataclass
class ServerMetrics:
    """Counters kept by the server on the engine thread (copied for each scrape)."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # hit tokens per tier
    rejected_queue_full: int = 0
    aborted: int = 0  # client disconnects
    history_rewrites: int = 0
    prompt_encodings: dict[str, int] = field(default_factory=dict)
    engine_errors: int = 0  # steps that raised as a whole
    request_errors: int = 0  # requests the engine failed alone (the others went on)
    load_seconds: Histogram = field(default_factory=lambda: Histogram(LOAD_BUCKETS))
    load_gb_per_s: Histogram = field(default_factory=lambda: Histogram(GBPS_BUCKETS))

    def copy(self) -> ServerMetrics:
        return copy.deepcopy(self)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        if math.isnan(v):
            return "NaN"
        return repr(v)
    return str(v)


class _Writer:
    def __init__(self, labels: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.base = labels

    def _labels(self, extra: dict[str, str] | None = None) -> str:
        lab = {**self.base, **(extra or {})}
        if not lab:
            return ""
        return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in lab.items()) + "}"

    def metric(self, name: str, kind: str, help: str,
               samples: list[tuple[dict[str, str] | None, float]]) -> None:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help}")
        self.lines.append(f"# TYPE {full} {kind}")
        for labels, v in samples:
            self.lines.append(f"{full}{self._labels(labels)} {_num(v)}")

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help}")
        self.lines.append(f"# TYPE {full} histogram")
        acc = 0
        for b, c in zip(list(h.buckets) + [math.inf], h.counts):
            acc += c
            le = "+Inf" if math.isinf(b) else repr(float(b))
            self.lines.append(f"{full}_bucket{self._labels({'le': le})} {acc}")
        self.lines.append(f"{full}_sum{self._labels()} {_num(h.sum)}")
        self.lines.append(f"{full}_count{self._labels()} {h.count}")


_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _engine_series(name: str, value, taken: set[str]) -> tuple[str, str, str, list] | None:
    if name in ENGINE_FIELDS:
        metric, kind, help = ENGINE_FIELDS[name]
    else:
        clean = _NAME_RE.sub("_", name)
        metric = clean if clean not in taken else f"engine_{clean}"
        kind = "counter" if clean.endswith("_total") else "gauge"
        help = f"LLMEngine.stats()['{name}']."
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return metric, kind, help, [(None, value)]
    if isinstance(value, dict) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        label = ("tier" if "tier" in name else "reason" if "reason" in name
                 else "source" if name.startswith("spec_") else "key")
        return metric, kind, help, [({label: str(k)}, v) for k, v in sorted(value.items())]
    return None


# Names of the server's own series (engine fields never take them).
_SERVER_NAMES = {"request_success_total", "prompt_tokens_total", "generation_tokens_total",
                 "requests_rejected_total", "requests_aborted_total",
                 "chat_history_rewrites_total", "prompt_encodings_total",
                 "engine_errors_total", "request_errors_total", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds"}


def render(engine_stats: dict, m: ServerMetrics, model_name: str) -> str:
    w = _Writer({"model_name": model_name})
    taken = set(_SERVER_NAMES) | {v[0] for v in ENGINE_FIELDS.values()}
    emitted = set()
    for name, value in engine_stats.items():
        s = _engine_series(name, value, taken)
        if s is not None and s[0] not in emitted:
            emitted.add(s[0])
            w.metric(*s)
    if "prefix_cache_hits_by_tier_total" not in emitted:  # an engine without per-tier stats
        w.metric("prefix_cache_hits_by_tier_total", "counter",
                 "Prompt tokens served from the prefix cache, by the tier they came from "
                 "(counted when a request ends).",
                 [({"tier": t}, v) for t, v in sorted(m.cached_by_tier.items())]
                 or [({"tier": "device"}, 0)])
    w.metric("request_success_total", "counter", "Finished requests by finish reason.",
             [({"finished_reason": r}, v) for r, v in sorted(m.finished.items())]
             or [({"finished_reason": "stop"}, 0)])
    w.metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
             [(None, m.prompt_tokens)])
    w.metric("generation_tokens_total", "counter", "Generated tokens of finished requests.",
             [(None, m.generation_tokens)])
    w.metric("requests_rejected_total", "counter",
             "Requests answered 429 because the queue was full.",
             [({"reason": "queue_full"}, m.rejected_queue_full)])
    w.metric("requests_aborted_total", "counter",
             "Requests aborted because the client disconnected.", [(None, m.aborted)])
    w.metric("chat_history_rewrites_total", "counter",
             "Chat requests whose template rewrote earlier turns (prefix reuse stops there).",
             [(None, m.history_rewrites)])
    w.metric("prompt_encodings_total", "counter",
             "Prompts by how they were encoded (extended: earlier prompt + generated ids kept).",
             [({"encoding": k}, v) for k, v in sorted(m.prompt_encodings.items())]
             or [({"encoding": "rendered"}, 0)])
    w.metric("engine_errors_total", "counter", "Engine steps that raised as a whole.",
             [(None, m.engine_errors)])
    w.metric("request_errors_total", "counter",
             "Requests that failed alone inside the engine (the others went on).",
             [(None, m.request_errors)])
    w.histogram("time_to_first_token_seconds", "Time from request arrival to first token.",
                m.ttft)
    w.histogram("time_per_output_token_seconds",
                "Mean time between output tokens, per request.", m.tpot)
    w.histogram("e2e_request_latency_seconds", "Time from request arrival to its end.", m.e2e)
    w.histogram("kv_load_seconds", "Per request with a lower-tier hit: time from queueing its "
                "KV load to the data in the device pool.", m.load_seconds)
    w.histogram("kv_load_throughput_gb_per_s", "Per request with a lower-tier hit: bytes "
                "loaded over that time (GB/s).", m.load_gb_per_s)
    return "\n".join(w.lines) + "\n"
