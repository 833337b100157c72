"""The KV cache: what a layer caches (``layout``), device pages (``pool``), chained page hashes
(``hashing``), the prefix index (``radix``), the scheduler's view (``cache_manager``), lower tiers
(``tiers/``), sliding-window rings (``window/``) and the builder that wires them (``build``)."""
