"""The lower tiers' counters as ``LLMEngine.stats()`` fields (the server exports every one:
numbers as counters or gauges, dicts as one series per key)."""

from __future__ import annotations

from typing import Any

from ..cache_stats import CacheStats
from .remote_store import REMOTE_COUNTERS


def tier_fields(s: CacheStats, t: dict[str, Any]) -> dict[str, Any]:
    """``s``: the cache manager's counters; ``t``: its ``tier_stats()``. Hit tokens per tier;
    bytes read/written per lower tier; loads (count, seconds total and max); pages evicted per
    tier; bad files on L3 by kind; every L3 write lost, by cause; pages held per tier; idle-time
    promotions."""
    b = t["backend"]
    promo = t["idle_promotion"]
    disk = b.get("disk", {})
    remote = b.get("remote")
    if remote is not None:  # the networked L3 store (--kv-store)
        out: dict[str, Any] = {f"cache_remote_{k}_total": remote[k] for k in REMOTE_COUNTERS}
        out["cache_remote_available"] = b["remote_available"]
    else:
        out = {}
    return out | {
        "cache_pages_by_tier": t["pages"],
        "cache_capacity_pages_by_tier": t["capacity"],
        "cache_evicted_pages_by_tier": t["evicted"],
        "cache_bytes_read_by_tier": {"host": b["host_bytes_read"], "disk": b["disk_bytes_read"]},
        "cache_bytes_written_by_tier": {"host": b["host_bytes_written"],
                                        "disk": b["disk_bytes_written"]},
        "cache_loads_total": s.loads,
        "cache_loaded_pages_total": s.loaded_pages,
        "cache_load_seconds_total": s.load_seconds,
        "cache_load_seconds_max": s.load_seconds_max,
        "cache_load_failures_total": s.load_failures,
        "cache_streamed_loads_total": s.streamed_loads,
        "cache_streamed_rewinds_total": s.streamed_rewinds,
        "cache_load_bytes_by_tier": dict(s.load.bytes_by_tier),
        "cache_load_read_seconds_by_tier": dict(s.load.seconds_by_tier),
        "cache_checksum_failures_total": disk.get("checksum_failures", 0),
        "cache_corrupt_files_total": disk.get("corrupt_files", 0),
        "cache_foreign_files_total": disk.get("foreign_files", 0),
        "cache_mismatched_files_total": disk.get("mismatched_files", 0),
        "cache_disk_misses_total": disk.get("misses", 0),
        "cache_disk_write_errors_total": b["disk_write_errors"],
        "cache_disk_writes_dropped_total": b["disk_writes_dropped"],
        "cache_disk_pending_bytes": b["disk_pending_bytes"],
        "cache_disk_files": disk.get("entries", 0),
        "cache_disk_bytes": disk.get("bytes", 0),
        "cache_stale_disk_records_total": t["stale_disk_records"],
        # every L3 page not written, by cause (each also logged, rate-limited)
        "cache_disk_write_losses_by_reason_total": {
            "too_large": t["disk_skipped_too_large"] + disk.get("rejected", 0),
            "no_room": t["disk_skipped_no_room"],
            "queue_full": b["disk_writes_dropped"],
            "no_space": disk.get("write_errors_no_space", 0),
            "permission": disk.get("write_errors_permission", 0),
            "other_error": disk.get("write_errors_other", 0)},
        "cache_disk_stale_tmp_removed_total": disk.get("stale_tmp_removed", 0),
        # idle-time L3 -> L2 promotion (0 when off)
        "cache_idle_promoted_pages_total": promo.get("promoted_pages", 0),
        "cache_idle_promotions_dropped_total": promo.get("promotions_dropped", 0),
        "cache_idle_periods_total": promo.get("idle_periods", 0),
    }
