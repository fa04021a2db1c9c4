"""hold on ambiguity, owners, per-type alert thresholds: columns and a state check with 'held'

- `endpoints.on_ambiguous` / `event_types.on_ambiguous`: 'retry' or 'hold' (NULL: retry).
  A delivery whose attempt's outcome is ambiguous is held for a person when either says
  'hold' (delivery/worker/outcomes.py).
- `endpoints.owner` / `event_types.owner`: the team that owns a failure there;
  `endpoints.operational_owner`: an endpoint that takes only that owner's operational events.
- `event_types.alert_oldest_seconds`, `alert_error_rate`, `alert_processing_p95_seconds`:
  the thresholds of that workflow's alert signals (outbox/stats.py).
- `outbox_deliveries_dead()` (migration 0009) puts the owner in each `delivery.dead` it
  publishes: the endpoint's, else the event type's (summaries name none).
- `ck_deliveries_known_state_held`: the state check with 'held', added NOT VALID (no scan
  under the ACCESS EXCLUSIVE lock); 0032 validates it and 0033 drops the old check.

Every column is nullable without a default: adding them rewrites nothing. Their checks are
added NOT VALID too and validated by 0032 (every existing row is NULL there).

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

OWNER_FORMAT = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
STATES_WITH_HELD = "'scheduled', 'in_flight', 'succeeded', 'dead', 'discarded', 'held'"

# (table, constraint, condition): each added NOT VALID here, validated in 0032.
CHECKS = (
    ("deliveries", "ck_deliveries_known_state_held", f"state IN ({STATES_WITH_HELD})"),
    ("endpoints", "ck_endpoints_known_on_ambiguous", "on_ambiguous IN ('retry', 'hold')"),
    ("endpoints", "ck_endpoints_owner_format", f"owner ~ '{OWNER_FORMAT}'"),
    (
        "endpoints",
        "ck_endpoints_operational_owner_format",
        f"operational_owner ~ '{OWNER_FORMAT}'",
    ),
    ("event_types", "ck_event_types_known_on_ambiguous", "on_ambiguous IN ('retry', 'hold')"),
    ("event_types", "ck_event_types_owner_format", f"owner ~ '{OWNER_FORMAT}'"),
    (
        "event_types",
        "ck_event_types_alert_thresholds",
        "(alert_oldest_seconds IS NULL OR alert_oldest_seconds > 0)"
        " AND (alert_error_rate IS NULL OR (alert_error_rate > 0 AND alert_error_rate <= 1))"
        " AND (alert_processing_p95_seconds IS NULL OR alert_processing_p95_seconds > 0)",
    ),
)


def _migration(name: str) -> ModuleType:
    """An earlier migration by file name (file names are not importable)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"outbox_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ONE_BY_ONE = "'last_status_code', d.last_status_code),"
_WITH_OWNER = (
    "'last_status_code', d.last_status_code,\n"
    "                                       'owner', COALESCE(ep.owner, (\n"
    "                                           SELECT t.owner FROM event_types t\n"
    "                                           WHERE t.name = d.event_type))),"
)
_ENDPOINTS = "SELECT DISTINCT e.id, e.uid, e.tenant_id\n"


def _dead_function(*, with_owner: bool) -> str:
    """outbox_deliveries_dead() as 0009 installed it, or with the owner in each event."""
    source = _migration("0009_contract.py").DELIVERIES_DEAD
    if source.count(_ONE_BY_ONE) != 1 or source.count(_ENDPOINTS) != 1:
        raise RuntimeError("migration 0031: outbox_deliveries_dead() is not the one 0009 made")
    source = source.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    if not with_owner:
        return source
    source = source.replace(_ENDPOINTS, "SELECT DISTINCT e.id, e.uid, e.tenant_id, e.owner\n")
    return source.replace(_ONE_BY_ONE, _WITH_OWNER)


# The new columns, per table (all text or float, nullable, no default).
COLUMNS = {
    "deliveries": (),
    "endpoints": (("on_ambiguous", "text"), ("owner", "text"), ("operational_owner", "text")),
    "event_types": (
        ("on_ambiguous", "text"),
        ("owner", "text"),
        ("alert_oldest_seconds", "double precision"),
        ("alert_error_rate", "double precision"),
        ("alert_processing_p95_seconds", "double precision"),
    ),
}


def upgrade() -> None:
    # One statement per table, each its own transaction: the relay and the workers take
    # deliveries, endpoints and event_types in different orders, so holding one of them
    # while waiting for another could deadlock with them (tests/outbox/test_migration_locks.py).
    # Each statement can run again: a retry starts the migration over.
    with op.get_context().autocommit_block():
        for table, columns in COLUMNS.items():
            op.execute(_alter(table, columns))
    op.execute(_dead_function(with_owner=True))


def _alter(table: str, columns: tuple[tuple[str, str], ...]) -> str:
    """ALTER TABLE adding `columns` and (re)adding the table's checks NOT VALID."""
    actions = [f"ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in columns]
    for owner, name, condition in CHECKS:
        if owner == table:
            actions.append(f"DROP CONSTRAINT IF EXISTS {name}")
            actions.append(f"ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")
    return f"ALTER TABLE {table} " + ", ".join(actions)


def downgrade() -> None:
    op.execute(_dead_function(with_owner=False))
    for table, name, _ in reversed(CHECKS):
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}")
    for column in (
        "alert_processing_p95_seconds",
        "alert_error_rate",
        "alert_oldest_seconds",
        "owner",
        "on_ambiguous",
    ):
        op.drop_column("event_types", column)
    for column in ("operational_owner", "owner", "on_ambiguous"):
        op.drop_column("endpoints", column)
