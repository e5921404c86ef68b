"""The package's shape, checked from its source: rooms without import cycles, small classes, short
functions. Read with `ast`, so nothing is imported and every import counts, including the ones made
inside a function on first use (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardspeed"

MAX_METHODS = 30
MAX_FUNCTION_LINES = 80
# Argument parsers are one `add_argument` per flag; their length is the length of the flag list.
ARGUMENT_PARSERS = {("launcher/runner.py", "_build_parser")}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _room(path: Path) -> str:
    """The room a file belongs to: its top-level package or module under shardspeed/."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_rooms(path: Path, tree: ast.Module) -> set[str]:
    # The package a relative import starts from (a package's __init__ is inside it).
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)[:-1]
    rooms = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            targets = (
                [[*module, alias.name] for alias in node.names] if len(module) == 1 else [module]
            )
        else:
            continue
        for target in targets:
            if target[0] == "shardspeed" and len(target) > 1:
                rooms.add(target[1])
    return rooms


def room_graph() -> dict[str, set[str]]:
    """Room -> the rooms it imports (its own files excluded; only rooms that exist as files)."""
    existing = {_room(path) for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path, tree in _modules():
        room = _room(path)
        graph.setdefault(room, set()).update(_imported_rooms(path, tree) & existing - {room})
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for other in sorted(graph.get(room, ())):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            part = []
            while True:
                member = stack.pop()
                part.append(member)
                if member == room:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for room in sorted(graph):
        if room not in index:
            visit(room)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_rooms_import_each_other_without_cycles() -> None:
    graph = room_graph()
    assert "config" in graph and "comm" in graph["runtime"]
    cycles = _cycles(graph)
    assert not cycles, "rooms that import each other in a circle: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_lower_rooms_never_import_higher_ones() -> None:
    graph = room_graph()
    assert not graph["config"], graph["config"]
    for room in ("config", "comm", "zero", "precision", "optim"):
        assert not graph[room] & {"runtime", "pipe", "inference", "checkpoint"}, (room, graph[room])


def test_no_class_has_more_than_thirty_methods() -> None:
    large = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [
                    item
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > MAX_METHODS:
                    large.append(f"{path.relative_to(PACKAGE)}:{node.name} ({len(methods)})")
    assert not large, f"classes over {MAX_METHODS} methods: {large}"


def test_no_function_is_longer_than_eighty_lines() -> None:
    long = []
    for path, tree in _modules():
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and (where, node.name) not in ARGUMENT_PARSERS:
                    long.append(f"{where}:{node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
