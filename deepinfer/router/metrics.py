"""``GET /metrics`` of the router (Prometheus text): per worker, what was routed there, the
hit tokens the index predicted vs those the worker reported, its load and index state."""

from __future__ import annotations

from .workers import Worker

_PER_WORKER = (
    ("requests_total", "counter", "requests routed to the worker", lambda w: w.routed),
    ("predicted_hit_tokens_total", "counter",
     "prompt tokens the prefix index predicted the worker had cached",
     lambda w: w.predicted_hit_tokens),
    ("reported_hit_tokens_total", "counter",
     "prompt tokens the worker's responses reported cached (usage cached_tokens)",
     lambda w: w.reported_hit_tokens),
    ("connect_failures_total", "counter", "requests the worker refused to connect",
     lambda w: w.connect_failures),
    ("event_resets_total", "counter", "KV event streams restarted from a snapshot",
     lambda w: w.event_resets),
    ("healthy", "gauge", "1 while the worker is in rotation", lambda w: int(w.healthy)),
    ("in_flight_requests", "gauge", "requests open on the worker", lambda w: w.in_flight),
    ("active_pages", "gauge", "pages of the requests open on the worker (its load)",
     lambda w: w.active_pages),
    ("index_pages", "gauge", "pages the prefix index says the worker holds", None),
)


def render(workers: list[Worker], index_pages: dict[str, int], retries: int) -> str:
    out = []
    for name, kind, help_, value in _PER_WORKER:
        full = f"deepinfer_router_{name}"
        out += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
        for w in workers:
            v = index_pages[w.url] if value is None else value(w)
            out.append(f'{full}{{worker="{w.url}",role="{w.role}"}} {v}')
    out += ["# HELP deepinfer_router_retries_total requests sent again to another worker "
            "after a connect error", "# TYPE deepinfer_router_retries_total counter",
            f"deepinfer_router_retries_total {retries}"]
    return "\n".join(out) + "\n"
