"""squawk (a PostgreSQL migration linter) over the SQL of every migration.

The SQL is what `outbox migrate --sql` prints, one migration at a time. A rule squawk
flags is fixed, or excused below with the reason. Migrations 0001-0019 are excused
as they stand: every database 0.2.0 upgrades from has them applied (0.1.0's schema is
0019), so changing them could not help it, and they run again only on an empty
database, where each lock is instant and nothing has rows to rewrite or scan. 0019,
the one that could still be pending on a live database, now does nothing (0020 builds
its indexes concurrently). From 0020 on, every migration is linted clean or excused
here rule by rule, with the reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.migrate import offline_sql, offline_sql_per_migration

PG_VERSION = "18"  # the embedded server's major version

_BEFORE_0_2 = (
    "applied before 0.2.0 on every database this release upgrades from; reruns only on "
    "an empty database (a fresh install)"
)
# A constraint dropped IF EXISTS and added again in the same ALTER TABLE: such a step
# runs in an autocommit block (one table per transaction, tests/outbox/test_migration_locks.py)
# and a retry starts the migration over, so the drop makes the add safe to run twice.
_READDED = (
    "drops only the constraint the same statement adds again, so a retried migration can "
    "run it twice; on a first run there is nothing to drop"
)
# revision -> {rule: why it stays}. An excuse that no longer fires fails the test too,
# so this list never outlives what it excuses.
EXCUSED: dict[str, dict[str, str]] = {
    "0001": dict.fromkeys(
        ["prefer-bigint-over-int", "prefer-bigint-over-smallint", "prefer-text-field"],
        _BEFORE_0_2,
    ),
    "0002": dict.fromkeys(["prefer-bigint-over-int"], _BEFORE_0_2),
    "0003": dict.fromkeys(["require-concurrent-index-creation"], _BEFORE_0_2),
    "0004": dict.fromkeys(
        [
            "prefer-bigint-over-int",
            "prefer-bigint-over-smallint",
            "require-concurrent-index-creation",
        ],
        _BEFORE_0_2,
    ),
    "0006": dict.fromkeys(
        [
            "adding-foreign-key-constraint",
            "ban-drop-default",
            "constraint-missing-not-valid",
            "prefer-bigint-over-int",
            "require-concurrent-index-creation",
            "require-concurrent-index-deletion",
        ],
        _BEFORE_0_2,
    ),
    "0007": dict.fromkeys(
        [
            "prefer-bigint-over-int",
            "require-concurrent-index-creation",
            "require-concurrent-index-deletion",
        ],
        _BEFORE_0_2,
    ),
    "0008": dict.fromkeys(["require-concurrent-index-creation"], _BEFORE_0_2),
    "0009": dict.fromkeys(
        [
            "constraint-missing-not-valid",
            "prefer-bigint-over-int",
            "require-concurrent-index-creation",
        ],
        _BEFORE_0_2,
    ),
    "0010": dict.fromkeys(["require-concurrent-index-creation"], _BEFORE_0_2),
    "0013": dict.fromkeys(
        ["require-concurrent-index-creation", "require-concurrent-index-deletion"], _BEFORE_0_2
    ),
    "0017": dict.fromkeys(["ban-drop-function"], _BEFORE_0_2),
    "0018": dict.fromkeys(
        ["adding-serial-primary-key-field", "ban-drop-constraint", "constraint-missing-not-valid"],
        _BEFORE_0_2,
    ),
    "0025": {"ban-drop-constraint": _READDED},
    "0031": {"ban-drop-constraint": _READDED},
    "0033": {
        "ban-drop-constraint": (
            "the contract step of a check replaced online: 0031 added the wider state check "
            "(with 'held') NOT VALID, 0032 validated it, so the old narrower one guarantees "
            "nothing the new one does not"
        )
    },
}


def squawk() -> str:
    """The binary the squawk-cli wheel installs beside this Python."""
    found = shutil.which("squawk", path=str(Path(sys.executable).parent)) or shutil.which("squawk")
    if found is None:
        pytest.fail("squawk is not installed: pip install -e '.[test]' (squawk-cli)")
    return found


def lint(sql: str, tmp_path: Path, name: str) -> list[dict[str, object]]:
    path = tmp_path / f"{name}.sql"
    path.write_text(sql)
    result = subprocess.run(
        [squawk(), "--pg-version", PG_VERSION, "--reporter", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode not in (0, 1) or not result.stdout.strip():
        pytest.fail(f"squawk failed on {name}: {result.returncode} {result.stderr}")
    findings: list[dict[str, object]] = json.loads(result.stdout)
    return findings


MIGRATIONS = list(offline_sql_per_migration())


@pytest.mark.parametrize(("revision", "sql"), MIGRATIONS, ids=[r for r, _ in MIGRATIONS])
def test_squawk_finds_nothing_unexcused(revision: str, sql: str, tmp_path: Path) -> None:
    findings = lint(sql, tmp_path, revision)
    excused = EXCUSED.get(revision, {})
    flagged = {str(f["rule_name"]) for f in findings}
    unexcused = [
        f"{revision} line {f['line']}: {f['rule_name']}: {f['message']} ({f['help']})"
        for f in findings
        if f["rule_name"] not in excused
    ]
    assert not unexcused, "\n".join(unexcused) + "\n--- the SQL ---\n" + sql
    assert set(excused) <= flagged, f"{revision}: excused but no longer flagged, drop the excuse"


def test_nothing_from_0020_on_is_excused_as_old() -> None:
    """The blanket reason holds only for what 0.1.0 databases already have; from 0020 on
    the one rule excused is the contract step of a change made online (drop the old
    constraint once its replacement is validated), each with its own reason."""
    assert all(
        set(rules) <= {"ban-drop-constraint"}
        for revision, rules in EXCUSED.items()
        if revision >= "0020"
    )
    assert all(
        reason != _BEFORE_0_2
        for revision, rules in EXCUSED.items()
        if revision >= "0020"
        for reason in rules.values()
    )


def test_the_linter_catches_a_blocking_index_build(tmp_path: Path) -> None:
    """The lint is live: a plain CREATE INDEX on a table is flagged."""
    sql = offline_sql("0019", "0020").replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX")
    rules = {f["rule_name"] for f in lint(sql, tmp_path, "blocking")}
    assert "require-concurrent-index-creation" in rules
