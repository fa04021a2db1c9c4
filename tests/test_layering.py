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
