"""``GET /metrics`` of the router (Prometheus text): per worker, what was routed there, the
hit tokens the index predicted (and the part of them that was only pending: routed there,
no KV event yet) vs those the worker reported, its load and index state."""

from __future__ import annotations

from .index import PrefixIndex
from .workers import Worker

_PER_WORKER = (
    ("requests_total", "counter", "requests routed to the worker", lambda w: w.routed),
    ("predicted_hit_tokens_total", "counter",
     "prompt tokens the prefix index predicted the worker had cached",
     lambda w: w.predicted_hit_tokens),
    ("pending_hit_tokens_total", "counter",
     "the part of the predicted hit tokens that was pending (routed there, no KV event yet)",
     lambda w: w.pending_hit_tokens),
    ("reported_hit_tokens_total", "counter",
     "prompt tokens the worker's responses reported cached (usage cached_tokens)",
     lambda w: w.reported_hit_tokens),
    ("connect_failures_total", "counter", "requests the worker refused to connect",
     lambda w: w.connect_failures),
    ("event_resets_total", "counter", "KV event streams restarted from a snapshot",
     lambda w: w.event_resets),
    ("pool_waits_total", "counter",
     "requests held until the shared KV pool had the pages a peer computed",
     lambda w: w.pool_waits),
    ("pool_wait_timeouts_total", "counter", "of those, sent before the pool had them all",
     lambda w: w.pool_wait_timeouts),
    ("healthy", "gauge", "1 while the worker is in rotation", lambda w: int(w.healthy)),
    ("in_flight_requests", "gauge", "requests open on the worker", lambda w: w.in_flight),
    ("active_pages", "gauge", "pages (prompt + max_tokens) of the requests open on the worker",
     lambda w: w.active_pages),
    ("prefill_pages", "gauge", "pages the requests open on the worker still prefill (predicted)",
     lambda w: w.prefill_pages),
    ("decoding_requests", "gauge", "requests open on the worker past their first token",
     lambda w: w.decoding),
)
_INDEX = (("index_pages", "pages the prefix index says the worker holds", PrefixIndex.num_pages),
          ("device_pages", "of those, pages in the worker's device pool (L1)",
           PrefixIndex.device_pages),
          ("pending_pages", "pages routed to the worker that no KV event confirmed yet",
           PrefixIndex.num_pending))


def render(workers: list[Worker], index: PrefixIndex, retries: int) -> str:
    rows = list(_PER_WORKER) + [
        (name, "gauge", help_, lambda w, count=count: count(index, w.url))
        for name, help_, count in _INDEX]
    out = []
    for name, kind, help_, value in rows:
        full = f"deepinfer_router_{name}"
        out += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
        out += [f'{full}{{worker="{w.url}",role="{w.role}"}} {value(w)}' for w in workers]
    out += ["# HELP deepinfer_router_retries_total requests sent again to another worker "
            "after a connect error", "# TYPE deepinfer_router_retries_total counter",
            f"deepinfer_router_retries_total {retries}"]
    return "\n".join(out) + "\n"
