"""The serving modules' imports (parsed, not executed): no cycle among them, and the two protocol
peers (`server.py`, gRPC; `http_server.py`, OpenAI HTTP) never import each other: both go through
`frontend.py`."""

from __future__ import annotations

import ast
import os

SERVING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving")


def _modules() -> dict[str, str]:
    return {
        name[:-3]: os.path.join(SERVING, name)
        for name in sorted(os.listdir(SERVING))
        if name.endswith(".py") and name != "__init__.py"
    }


def _serving_imports(path: str, known: set[str]) -> set[str]:
    """The serving modules a file imports anywhere in it (module level or inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "serving" and len(parts) > 1 and parts[1] in known:
                out.add(parts[1])
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _serving_imports(path, set(modules)) - {m} for m, path in modules.items()}


def test_protocol_peers_do_not_import_each_other():
    graph = _graph()
    assert {"server", "http_server", "frontend"} <= set(graph)
    assert "http_server" not in graph["server"]
    assert "server" not in graph["http_server"]
    assert "frontend" in graph["server"] and "frontend" in graph["http_server"]
    assert not {"server", "http_server"} & graph["frontend"]


def test_no_import_cycle_between_serving_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
