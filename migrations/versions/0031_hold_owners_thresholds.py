"""hold on ambiguity, owners, per-type alert thresholds: columns and a state check with 'held'

- `endpoints.on_ambiguous` / `event_types.on_ambiguous`: 'retry' or 'hold' (NULL: retry).
  A delivery whose attempt's outcome is ambiguous is held for a person when either says
  'hold' (delivery/worker/outcomes.py).
- `endpoints.owner` / `event_types.owner`: the team that owns a failure there;
  `endpoints.operational_owner`: an endpoint that takes only that owner's operational events.
- `event_types.alert_oldest_seconds`, `alert_error_rate`, `alert_processing_p95_seconds`:
  the thresholds of that workflow's alert signals (outbox/stats.py).
- `ck_deliveries_known_state_held`: the state check with 'held', added NOT VALID (no scan
  under the ACCESS EXCLUSIVE lock); 0032 validates it and 0033 drops the old check.

Every column is nullable without a default: adding them rewrites nothing. Their checks are
added NOT VALID too and validated by 0032 (every existing row is NULL there).

Revision ID: 0031
Revises: 0024
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0024"
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


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries, so it never queues every claim behind it.
    op.add_column("endpoints", sa.Column("on_ambiguous", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("owner", sa.Text(), nullable=True))
    op.add_column("endpoints", sa.Column("operational_owner", sa.Text(), nullable=True))
    op.add_column("event_types", sa.Column("on_ambiguous", sa.Text(), nullable=True))
    op.add_column("event_types", sa.Column("owner", sa.Text(), nullable=True))
    op.add_column("event_types", sa.Column("alert_oldest_seconds", sa.Float(), nullable=True))
    op.add_column("event_types", sa.Column("alert_error_rate", sa.Float(), nullable=True))
    op.add_column(
        "event_types", sa.Column("alert_processing_p95_seconds", sa.Float(), nullable=True)
    )
    for table, name, condition in CHECKS:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")


def downgrade() -> None:
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
