"""Benchmarks: trace loading and replay, workloads, ideal hit rates, client mode, reports.

Modules (one concept each): ``traces`` (block-hash trace loaders, scaling), ``ideal``
(infinite-cache hit rate), ``tokens`` (hash ids -> deterministic token blocks), ``workloads``
(chat / agent / doc-QA / dataset replay sessions), ``metrics`` (per-request records, summary
statistics), ``report`` (results folder: JSON, Markdown, PNG), ``client`` (OpenAI-compatible
endpoints), ``backends`` (an in-process engine, the transformers baseline), ``driver``
(sessions turn by turn through a backend), ``engine_bench`` (engine mode: one column per
engine config), the cache capacity planner (traces through the engine's cache code, no model:
``replay``, the grid ``sweep``, ``plan_report``), ``accuracy`` (teacher-forced accuracy of a
lossy KV tier), ``cli`` (``python -m deepinfer.bench``).
"""
