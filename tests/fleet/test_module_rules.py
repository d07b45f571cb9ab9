"""Rules about the code of engine/, producer/ and worker/ themselves.

- No import cycles: every import that runs (at the top of a module or inside a function; not
  those only a type checker reads) is an edge, and the graph of those edges has no cycle.
- Reply events are built only by their constructors in producer/events.py: no other module
  writes a map literal with an event's "type"."""

from __future__ import annotations

import ast
from pathlib import Path

from producer.events import EVENT_TYPES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "producer", "worker")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)  # `from producer import connection` names a module too:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return found & modules


def module_files() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for pkg in PACKAGES
            for p in (ROOT / pkg).rglob("*.py") if p.stem != "__init__"}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    modules = set(files)
    return {name: _imports(ast.parse(path.read_text()), modules) - {name}
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_engine_producer_and_worker_modules_import_no_cycle() -> None:
    graph = import_graph()
    assert {"producer.client", "producer.results", "worker.loop", "worker.quarantine",
            "engine.block_manager", "engine.prefix_cache",
            "engine.attention.selector"} <= set(graph)
    assert "producer.errors" in graph["producer.results"]  # (the graph sees real edges)
    assert "engine.prefix_cache" in graph["engine.block_manager"]
    assert find_cycle(graph) is None


def event_literals(tree: ast.AST) -> list[int]:
    """Lines of map literals whose "type" is a reply event's type."""
    kinds = {*EVENT_TYPES, "restart"}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Dict) and any(
        isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant)
        and v.value in kinds for k, v in zip(node.keys, node.values, strict=True))]


def test_the_event_literal_finder_finds_one() -> None:
    assert event_literals(ast.parse('x = {"a": 1, "type": "tokens"}\ny = {"type": "x"}')) == [1]


def test_reply_events_are_built_only_by_their_constructors() -> None:
    found = {name: event_literals(ast.parse(path.read_text()))
             for name, path in module_files().items() if name != "producer.events"}
    assert {name: lines for name, lines in found.items() if lines} == {}
