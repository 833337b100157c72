"""Lower KV tiers: L2 host memory and L3 disk under the device pool (L1).

``policy`` decides what moves where and when (no tensors); a ``backend`` moves it: ``tier_io``
in the engine (threads, copies), the counting backend in the planner. ``page_bytes`` is a
page's byte format, ``codecs`` its optional compression, ``host_store`` / ``disk_store`` where
the bytes live.
"""
