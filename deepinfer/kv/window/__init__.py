"""Sliding-window layers: the window group (``layout``), per-sequence rings (``rings``) in their
own device pool (``pool``), window snapshots (``snapshots``) and prefix reuse on hybrid models
(``manager``, the cache manager of such models)."""
