"""Every benchmark measures the engine under its own thread policy.

``import deepinfer`` sets the passive OpenMP wait policy before torch loads libgomp; a script that
imports torch (or transformers) first runs with spinning workers instead, so its figures are not
the engine's (the eleventh session's TTFT benchmark compared a spinning parent with a passive
child this way). Checked on the source text: the first torch/transformers import of each script
must come after a deepinfer import, or after a benchmark module that does so.
"""

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TORCH = {"torch", "transformers"}


def imported(node: ast.AST) -> set[str]:
    """The top-level packages an import statement loads."""
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


def loads_first(path: Path, seen: frozenset[Path] = frozenset()) -> str | None:
    """"deepinfer" or "torch": which one ``path`` loads first, in source order, through sibling
    benchmark modules too; None if neither."""
    imports = sorted((n for n in ast.walk(ast.parse(path.read_text())) if imported(n)),
                     key=lambda n: (n.lineno, n.col_offset))
    for node in imports:
        for root in sorted(imported(node)):
            sibling = BENCHMARKS / f"{root}.py"
            if root == "deepinfer":
                return "deepinfer"
            if root in TORCH:
                return "torch"
            if sibling.exists() and sibling not in seen and (first := loads_first(sibling, seen | {path})):
                return first
    return None


def test_every_benchmark_imports_deepinfer_before_torch():
    late = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if loads_first(p) == "torch"]
    assert late == []


def test_the_check_sees_a_torch_first_script(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nimport torch\nimport deepinfer\n")
    good = tmp_path / "good.py"
    good.write_text("import deepinfer\nimport torch\n")
    assert loads_first(bad) == "torch" and loads_first(good) == "deepinfer"
