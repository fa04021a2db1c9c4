"""The two rooms stay apart: the send path never imports the operator side, and outbox/
(what applications import) imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files(folder: str, *, skip: str | None = None) -> list[Path]:
    return [
        path
        for path in sorted((ROOT / folder).rglob("*.py"))
        if skip is None or skip not in path.relative_to(ROOT).parts
    ]


@pytest.mark.parametrize(
    ("folder", "skip", "forbidden"),
    [
        ("outbox", None, ("delivery",)),
        ("delivery", "operator", ("delivery.operator",)),
    ],
)
def test_lower_rooms_do_not_import_upper_ones(
    folder: str, skip: str | None, forbidden: tuple[str, ...]
) -> None:
    offenders = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _files(folder, skip=skip)
        for module in _imported_modules(path)
        if any(module == name or module.startswith(name + ".") for name in forbidden)
    }
    assert offenders == set()


def test_the_check_sees_an_import_when_there_is_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from delivery.operator.api import x\nimport delivery.operator.cli\n")
    assert _imported_modules(sample) == {"delivery.operator.api", "delivery.operator.cli"}


def _outbox_import_graph() -> dict[str, set[str]]:
    """outbox's modules -> the outbox modules each imports, at any depth of the file
    (a function-level import ties modules together as much as a top-level one)."""
    package = ROOT / "outbox"
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from outbox import queries` imports the module outbox.queries
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in modules:
                        edges.add(submodule)
                    elif node.module in modules:
                        edges.add(node.module)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_outbox_modules_import_each_other_in_no_circle() -> None:
    """A circle (A imports B imports A) means two modules own one job between them."""
    assert _cycles(_outbox_import_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
