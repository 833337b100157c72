"""Benchmarks: trace loading and replay, workloads, ideal hit rates, client mode, reports.

Modules (one concept each): ``traces`` (block-hash trace loaders, scaling), ``ideal``
(infinite-cache hit rate), ``tokens`` (hash ids -> deterministic token blocks), ``workloads``
(chat / agent / doc-QA / dataset replay sessions), ``metrics`` (per-request records, summary
statistics), ``report`` (results folder: JSON, Markdown, PNG), ``client`` (OpenAI-compatible
endpoints), ``engine_driver`` (in-process engine configs and the transformers baseline),
``planner`` (cache capacity planner: traces through the engine's cache code, no model),
``cli`` (``python -m deepinfer.bench``).
"""
