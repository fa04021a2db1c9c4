"""`import outbox` is light and `outbox.publish` is always the function: publish() and
publish_async() load on first use, whatever imported the submodule `outbox.publish`
first. Each case runs in a fresh interpreter (this one has everything loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_importing_outbox_loads_no_database_stack_until_publish_is_used() -> None:
    out = _run(
        "import sys, outbox\n"
        "heavy = ('sqlalchemy', 'psycopg', 'jsonschema', 're2', 'pydantic')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "outbox.publish\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert out.splitlines() == ["[]", "['jsonschema', 'psycopg', 're2', 'sqlalchemy']"]


@pytest.mark.parametrize(
    "first",
    [
        "import outbox.publish",
        "from outbox.publish import publish_async",
        "import outbox.priorities",  # imports the submodule on its own behalf
        "import outbox; outbox.publish_async",
    ],
)
def test_outbox_publish_is_the_function_whatever_came_first(first: str) -> None:
    out = _run(
        f"{first}\n"
        "import sys, types, outbox\n"
        "print(type(outbox.publish).__name__)\n"
        "from outbox import publish, publish_async\n"
        "print(type(outbox.publish).__name__, outbox.publish is publish)\n"
        "print(isinstance(sys.modules['outbox.publish'], types.ModuleType))\n"
        "print(publish_async is sys.modules['outbox.publish'].publish_async)\n"
    )
    assert out.splitlines() == ["function", "function True", "True", "True"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    out = _run(
        "import outbox\ntry:\n    outbox.publsh\nexcept AttributeError as exc:\n    print(exc)\n"
    )
    assert out == "module 'outbox' has no attribute 'publsh'"
