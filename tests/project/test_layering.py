"""The two rooms stay apart: the send path never imports the operator side, and outbox/
(what applications import) imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT


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


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (`from a import b` counts as a.b
    when b is a module), read with ast: nothing is imported to find out."""
    folder = root / package.replace(".", "/")
    modules = {_module_name(path, root): path for path in sorted(folder.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as the path that closes it (a depth-first search)."""
    circles: list[list[str]] = []
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return circles


def test_the_operator_side_has_no_import_circle() -> None:
    graph = _import_graph(ROOT, "delivery.operator")
    assert "delivery.operator.api.core" in graph["delivery.operator.api.deliveries"]
    assert _circles(graph) == []


@pytest.mark.parametrize("package", ["outbox", "delivery"])
def test_no_package_imports_itself_in_a_circle(package: str) -> None:
    """A circle (A imports B imports A) means two modules own one job between them;
    function-level imports count as much as top-level ones."""
    graph = _import_graph(ROOT, package)
    assert graph, package
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f() -> None:\n    import pkg.c\n")
    (package / "c.py").write_text("from pkg import a\n")
    assert _circles(_import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
