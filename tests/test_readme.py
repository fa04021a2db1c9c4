"""The README keeps telling the truth about settings and secrets."""

from __future__ import annotations

import re
from pathlib import Path

from outbox.settings import Settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_one_settings_table_lists_every_setting() -> None:
    headings = re.findall(r"^#+ Settings$", README, re.MULTILINE)
    assert headings == ["## Settings"]
    table = _section("Settings")
    listed = set(re.findall(r"^\| `(OUTBOX_[A-Z0-9_]+)`", table, re.MULTILINE))
    expected = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields}
    expected |= {"OUTBOX_ENV_FILE", "OUTBOX_PROCESSES"}
    assert expected - listed == set(), "settings missing from the README's table"
    assert listed - expected == set(), "README lists settings that do not exist"


def test_secrets_are_documented_as_revealable_and_keys_as_rotatable() -> None:
    # Signing secrets can be printed again (API tokens really are shown once).
    assert re.search(r"secret[^.|]*shown once", README, re.IGNORECASE) is None
    assert "outbox endpoints reveal-secret" in README
    assert "outbox keys rotate" in README


def test_the_contents_line_fits_one_screen() -> None:
    contents = README.split("Contents:", 1)[1].split("\n\n", 1)[0]
    assert len(contents.splitlines()) <= 8
