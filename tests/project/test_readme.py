"""The README and the documentation site keep telling the truth about settings and secrets,
and the README stays a newcomer's first ten minutes (the depth lives under docs/)."""

from __future__ import annotations

import re

from outbox.settings import Settings
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = {path.relative_to(DOCS).as_posix(): path.read_text() for path in DOCS.rglob("*.md")}
TRY_IT = "    python3 -m venv .venv && .venv/bin/pip install -e '.[all]' && .venv/bin/outbox demo"
TEST_IT = (
    "    python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
    " && .venv/bin/python -m pytest -q"
)


def test_one_settings_table_lists_every_setting() -> None:
    headings = [
        (name, heading)
        for name, text in {"README.md": README, **PAGES}.items()
        for heading in re.findall(r"^#+ Settings$", text, re.MULTILINE)
    ]
    assert headings == [("settings.md", "# Settings")]
    table = PAGES["settings.md"]
    listed = set(re.findall(r"^\| `(OUTBOX_[A-Z0-9_]+)`", table, re.MULTILINE))
    expected = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields}
    expected |= {"OUTBOX_ENV_FILE", "OUTBOX_PROCESSES"}
    assert expected - listed == set(), "settings missing from docs/settings.md's table"
    assert listed - expected == set(), "docs/settings.md lists settings that do not exist"


def test_secrets_are_documented_as_revealable_and_keys_as_rotatable() -> None:
    # Signing secrets can be printed again (API tokens really are shown once).
    for name, text in {"README.md": README, **PAGES}.items():
        assert re.search(r"secret[^.|]*shown once", text, re.IGNORECASE) is None, name
    assert "outbox endpoints reveal-secret" in PAGES["publishing.md"]
    assert "outbox keys rotate" in PAGES["security.md"]


def test_the_contents_line_fits_one_screen() -> None:
    contents = README.split("Contents:", 1)[1].split("\n\n", 1)[0]
    assert len(contents.splitlines()) <= 8


def test_the_readme_fits_the_first_ten_minutes_with_both_commands_at_the_top() -> None:
    lines = README.splitlines()
    assert len(lines) <= 250, f"the README has {len(lines)} lines; move the depth to docs/"
    top = lines[:20]
    assert TRY_IT in top and TEST_IT in top, "the Try it / Test it commands left the top"
    assert top.index(TRY_IT) < top.index(TEST_IT)
    sections = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert sections == [
        "Publishing from application code",
        "Verifying on the receiver side",
        "The outcome contract",
        "Running it",
        "Where to go next",
    ]


def test_every_relative_link_in_the_readme_reaches_a_file() -> None:
    """The README is read on the forge, not built by mkdocs: its links are checked here."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    relative = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert relative, "the README links nowhere into the docs"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert missing == []
    linked_pages = {t.removeprefix("docs/") for t in relative if t.startswith("docs/")}
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in linked_pages:
        assert page in nav, f"{page} is linked from the README but not in mkdocs.yml's nav"


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()


def test_the_install_table_lists_what_each_extra_installs() -> None:
    """docs/getting-started.md's table: a row per role extra, naming each distribution the
    bare package or that extra brings (so a dependency moved in pyproject.toml is moved
    in the table too)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    rows = {
        match.group(1): match.group(2).lower()
        for match in re.finditer(
            r"^\| `(?:webhook-outbox)?(\[[a-z]+\])?`? \|[^|]*\| ([^|]*) \|$",
            PAGES["getting-started.md"],
            re.MULTILINE,
        )
    }
    rows = {("" if key is None else key.strip("[]")): text for key, text in rows.items()}
    assert {"", "service", "console", "embedded", "all", "docs", "test"} <= set(rows)
    assert set(rows) - {""} <= set(extras), "the table names an extra pyproject.toml lacks"
    for extra in ("", "service", "console", "embedded"):
        requirements = project["dependencies"] if extra == "" else extras[extra]
        named = [_requirement_name(r) for r in requirements if not r.startswith("webhook-outbox")]
        missing = [name for name in named if name not in rows[extra]]
        assert missing == [], f"the {extra or 'bare'} row does not name {missing}"
