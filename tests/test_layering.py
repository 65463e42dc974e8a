"""Package layering: packages depend downward only (`serving -> jaxinfer -> checkpoints`).

1. Every module's imports are read with `ast` (function-level imports included), not executed.
2. Each rule names a set of modules and the packages they must not import; a violation is
   reported as "module: imported name".
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    """Absolute module names `path` imports (`from a.b import c` gives `a.b` and `a.b.c`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(paths: list[Path], forbidden: str) -> list[str]:
    return sorted(
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in paths
        for name in _imported_modules(path)
        if name == forbidden or name.startswith(f"{forbidden}.")
    )


def test_checkpoints_import_nothing_from_jaxinfer() -> None:
    paths = sorted((REPO_ROOT / "checkpoints").rglob("*.py"))
    assert paths
    assert _violations(paths, "jaxinfer") == []


def test_loader_imports_nothing_from_the_engine() -> None:
    assert _violations([REPO_ROOT / "jaxinfer" / "loader.py"], "jaxinfer.engine") == []


def test_serving_imports_neither_the_runner_nor_the_scheduler() -> None:
    """Serving talks to the engine through `jaxinfer.engine.types` and the core's public surface."""
    paths = sorted((REPO_ROOT / "serving").glob("*.py"))
    assert paths
    for inner in ("jaxinfer.engine.runner", "jaxinfer.engine.scheduler"):
        assert _violations(paths, inner) == [], inner
