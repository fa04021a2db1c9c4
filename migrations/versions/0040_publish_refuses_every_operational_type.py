"""outbox_publish(): refuse every operational event type, with its own SQLSTATE (OB403)

`publish()` refuses the event types the service publishes itself (outbox.catalogue's
OPERATIONAL_EVENT_TYPES), but outbox_publish() still checked the list migration 0009 wrote,
so `delivery.held` (added with hold on ambiguity) was accepted from SQL: an application
could forge the service's own "needs review" event. The list now lives in the database in
one place, `outbox_operational_event_types()` (tests/outbox/test_operational_types.py
compares it with Python's), and the refusal has its own SQLSTATE, OB403 ("reserved event
type", class OB is this project's own, like OB409), so a caller can tell it from bad input.

Only functions change (CREATE OR REPLACE, no table is locked): a session that calls
outbox_publish() mid-migration gets the old or the new body, both valid.

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None

# The service's own event types as of this migration. A new one is added by a migration
# that replaces outbox_operational_event_types(); the test above fails until it does.
OPERATIONAL_EVENT_TYPES = (
    "endpoint.disabled",
    "endpoint.breaker_opened",
    "endpoint.recovered",
    "delivery.dead",
    "delivery.held",
    "tenant.disabled",
)

# The SQLSTATE of an application publishing an operational event type (docs/contract.md).
RESERVED_SQLSTATE = "OB403"

_LITERALS = ", ".join(f"'{name}'" for name in OPERATIONAL_EVENT_TYPES)
OPERATIONAL_TYPES_FUNCTION = f"""
CREATE OR REPLACE FUNCTION outbox_operational_event_types() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY[{_LITERALS}]::text[]
$$
"""

NEW_CHECK = f"""    IF p_event_type = ANY (outbox_operational_event_types()) THEN
        RAISE EXCEPTION 'outbox_publish: % is an operational event the service publishes itself',
            quote_literal(p_event_type)
            USING ERRCODE = '{RESERVED_SQLSTATE}',
                  HINT = 'choose another event type; reserved: '
                         || array_to_string(outbox_operational_event_types(), ', ');
    END IF;
"""


def _migration(name: str) -> ModuleType:
    """An earlier migration by file name (file names are not importable)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"outbox_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _previous() -> str:
    """The nine-argument function as migration 0030 made it, as a CREATE OR REPLACE."""
    made = _migration("0030_publish_conflict_and_subject.py")
    source = str(made._nine_arguments(made._with_conflict_and_subject(made._previous())))
    return _once(
        source, "CREATE FUNCTION outbox_publish(", "CREATE OR REPLACE FUNCTION outbox_publish("
    )


def _once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"migration 0040: {old.strip()!r} is not once in outbox_publish()")
    return source.replace(old, new)


def _old_check() -> str:
    types = _migration("0009_contract.py").OPERATIONAL_TYPES
    return (
        f"    IF p_event_type IN ({types}) THEN\n"
        "        RAISE EXCEPTION 'outbox_publish: % is an operational event the service "
        "publishes itself',\n"
        "            p_event_type USING ERRCODE = '22023', HINT = 'choose another event type';\n"
        "    END IF;\n"
    )


def upgrade() -> None:
    op.execute(OPERATIONAL_TYPES_FUNCTION)
    op.execute(_once(_previous(), _old_check(), NEW_CHECK))


def downgrade() -> None:
    op.execute(_previous())
    op.execute("DROP FUNCTION outbox_operational_event_types()")
