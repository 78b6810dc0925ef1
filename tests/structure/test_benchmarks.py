"""The benchmark scripts import each other without a circle (imports inside functions count: moving
an import into a function only hides a circle), so any one of them can be imported or run alone."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def sibling_imports() -> dict[str, set[str]]:
    """For every script in benchmarks/ (and its subfolders), the scripts of benchmarks/ it imports."""
    scripts = {path.stem: path for path in BENCHMARKS.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in scripts.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = (found & scripts.keys()) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_benchmark_scripts_import_each_other_without_a_circle():
    graph = sibling_imports()
    assert "bench_write" in graph["cpu_stages"]  # the graph sees what it should
    assert circles(graph) == []
