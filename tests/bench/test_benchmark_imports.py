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
TORCH = ("torch", "transformers")


def imported(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def policy_first(path: Path, seen: dict[Path, bool]) -> bool:
    """Whether ``path`` imports deepinfer (itself or through a sibling benchmark) before torch."""
    if path in seen:
        return seen[path]
    seen[path] = True  # a cycle decides nothing
    nodes = sorted((n for n in ast.walk(ast.parse(path.read_text())) if imported(n)),
                   key=lambda n: (n.lineno, n.col_offset))
    result = True
    for node in nodes:
        roots = {name.split(".")[0] for name in imported(node)}
        if "deepinfer" in roots:
            break
        sibling = [BENCHMARKS / f"{r}.py" for r in roots if (BENCHMARKS / f"{r}.py").exists()]
        if sibling and all(policy_first(s, seen) for s in sibling):
            if any(imports_deepinfer(s) for s in sibling):
                break
        if roots & set(TORCH):
            result = False
            break
    seen[path] = result
    return result


def imports_deepinfer(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any("deepinfer" in {n.split(".")[0] for n in imported(node)} for node in ast.walk(tree))


def test_every_benchmark_imports_deepinfer_before_torch():
    seen: dict[Path, bool] = {}
    late = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if not policy_first(p, seen)]
    assert late == []


def test_the_check_sees_a_torch_first_script(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nimport torch\nimport deepinfer\n")
    good = tmp_path / "good.py"
    good.write_text("import deepinfer\nimport torch\n")
    assert not policy_first(bad, {}) and policy_first(good, {})
