"""outbox_publish(): refuse a reused idempotency key with other input; take a subject

The same idempotency key (per tenant) with another event type, payload or ordering key is
a caller's bug: it used to return the first event's id, and the second event was lost.
Now it raises SQLSTATE OB409 ("idempotency conflict", class OB is this project's own)
naming the key and the first event's message id; nothing is written (the insert did
nothing), though, as with every error in a function, the caller's transaction is aborted.
The same input again still returns the first id. Payloads are compared by the sha256 of
their canonical text (PostgreSQL's jsonb rendering: key order and whitespace do not
matter; 1 and 1.0 differ, as the receiver would see them differ), stored in
`outbox_events.payload_hash` (0028) and computed on the fly for rows without one.

The subject comes through a nine-argument overload, every argument required (NULL for a
default): `outbox_publish(tenant, type, payload, idempotency_key, ordering_key, priority,
max_payload_bytes, max_payload_depth, subject)`. It holds the whole function; the
eight-argument one (unchanged signature, defaults and grants: CREATE OR REPLACE) now calls
it with no subject, so every existing call keeps working and gets the conflict check.
Neither signature is dropped (a client may be calling it mid-migration), and no call is
ambiguous: calls of up to eight arguments match only the old form, nine only the new.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

NEW_SIGNATURE = "outbox_publish(text, text, jsonb, text, text, integer, integer, integer, text)"

# The SQLSTATE of an idempotency conflict (documented in docs/contract.md).
CONFLICT_SQLSTATE = "OB409"

SUBJECT_CHECK = """    IF p_subject IS NOT NULL
       AND (length(p_subject) NOT BETWEEN 1 AND 255 OR p_subject ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'outbox_publish: subject must be 1 to 255 characters without control characters'
            USING ERRCODE = '22023', HINT = 'name the document, e.g. invoice/inv_7';
    END IF;
"""

OLD_LOOKUP = """    SELECT message_id INTO found_id FROM outbox_events o
    WHERE o.tenant_id = v_tenant AND o.idempotency_key = p_idempotency_key;
    RETURN found_id;
"""

# Read again after the insert: in READ COMMITTED each statement sees the rows committed
# before it, so an insert that waited on a concurrent twin (and did nothing) finds it here.
NEW_LOOKUP = f"""    SELECT o.message_id,
           CASE WHEN o.event_type <> p_event_type THEN 'event type'
                WHEN o.ordering_key IS DISTINCT FROM p_ordering_key THEN 'ordering key'
                WHEN coalesce(o.payload_hash, sha256(convert_to(o.payload::text, 'UTF8')))
                     <> v_hash THEN 'payload'
           END
    INTO found_id, differs FROM outbox_events o
    WHERE o.tenant_id = v_tenant AND o.idempotency_key = p_idempotency_key;
    IF differs IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_publish: idempotency key % was already used by % with another %',
            quote_literal(p_idempotency_key), found_id, differs
            USING ERRCODE = '{CONFLICT_SQLSTATE}',
                  HINT = 'a key stands for one operation: publish other input under a new key';
    END IF;
    RETURN found_id;
"""  # noqa: S608 - constant fragments only


def _migration(name: str) -> ModuleType:
    """An earlier migration by file name (file names are not importable)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"outbox_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _previous() -> str:
    """The function as migration 0021 left it (CREATE OR REPLACE)."""
    ceilings = _migration("0021_publish_ceilings.py")
    return str(ceilings._with_ceilings(ceilings._previous()))


def _once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"migration 0030: {old.strip()!r} is not once in outbox_publish()")
    return source.replace(old, new)


def _with_conflict_and_subject(old: str) -> str:
    depth_param = "    p_max_payload_depth integer DEFAULT 64\n"
    new = _once(old, depth_param, depth_param.rstrip("\n") + ",\n    p_subject text DEFAULT NULL\n")
    new = _once(new, "    found_id text;\n", "    found_id text;\n    differs text;\n"
                "    v_hash bytea;\n")  # fmt: skip
    priority_check = "    IF p_priority IS NOT NULL AND p_priority NOT BETWEEN -100 AND 100 THEN\n"
    new = _once(new, priority_check, SUBJECT_CHECK + priority_check)
    idle = "    idle := NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL);\n"
    new = _once(
        new,
        idle,
        "    IF p_idempotency_key IS NOT NULL THEN\n"
        "        v_hash := sha256(convert_to(p_payload::text, 'UTF8'));\n"
        "    END IF;\n" + idle,
    )
    new = _once(
        new,
        "         validate_pending)\n",
        "         validate_pending, subject, payload_hash)\n",
    )
    new = _once(new, "            true)\n", "            true, p_subject, v_hash)\n")
    return _once(new, OLD_LOOKUP, NEW_LOOKUP)


# The eight-argument form, as it stays for existing callers: the nine-argument one with no
# subject (a SQL function: one call, nothing of its own to keep in step).
FORWARD = """
CREATE OR REPLACE FUNCTION outbox_publish(
    p_tenant text,
    p_event_type text,
    p_payload jsonb,
    p_idempotency_key text DEFAULT NULL,
    p_ordering_key text DEFAULT NULL,
    p_priority integer DEFAULT NULL,
    p_max_payload_bytes integer DEFAULT 65536,
    p_max_payload_depth integer DEFAULT 64
) RETURNS text
LANGUAGE sql AS $$
    SELECT outbox_publish(p_tenant, p_event_type, p_payload, p_idempotency_key,
                          p_ordering_key, p_priority, p_max_payload_bytes,
                          p_max_payload_depth, CAST(NULL AS text))
$$
"""


def _nine_arguments(source: str) -> str:
    """The function with p_subject, as a new overload whose every argument is required."""
    new = _once(
        source, "CREATE OR REPLACE FUNCTION outbox_publish(", "CREATE FUNCTION outbox_publish("
    )
    parameters, rest = new.split(") RETURNS text", 1)
    return re.sub(r" DEFAULT [^,\n]+", "", parameters) + ") RETURNS text" + rest


def upgrade() -> None:
    op.execute(_nine_arguments(_with_conflict_and_subject(_previous())))
    op.execute(FORWARD)


def downgrade() -> None:
    op.execute(_previous())
    op.execute(f"DROP FUNCTION {NEW_SIGNATURE}")
