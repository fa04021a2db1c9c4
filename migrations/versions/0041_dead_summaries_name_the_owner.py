"""delivery.dead summaries name the owner: one summary per owner of the held-back deaths

Past the storm bound (3 a minute per endpoint) dead deliveries are counted and reported
after the minute in one summary per endpoint, which named nobody: the owner of a dead
delivery is its endpoint's owner, else its event type's (outbox/owners.py), so one
endpoint's summary can cover several teams' failures. Now each held-back death is counted
under its owner (`operational_event_marks.suppressed_owners`: owner -> count, '' for no
owner) and the flush publishes one summary per owner, with `owner` set (null: nobody owns
them). An endpoint that takes only one owner's operational events (`operational_owner`)
now receives that owner's summaries too; before, it never received a summary.

Deaths counted before this migration have no owner recorded: they are summarised under
the endpoint's owner (the owner of every delivery there when it has one, else null).

Also: a dead delivery OF an operational event reports nothing (no event loops), and the
list of those types is now outbox_operational_event_types() (migration 0040): a dead
`delivery.held` was reported as `delivery.dead` before.

The new column is nullable without a default (no rewrite); functions are replaced.

Revision ID: 0041
Revises: 0040
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0041"
down_revision = "0040"
branch_labels = None
depends_on = None

# One summary per owner of a window's held-back deaths at one endpoint. The key of the
# unowned one is the key summaries had before (a replayed flush stays deduplicated).
PUBLISH_DEAD_SUMMARIES = """
CREATE OR REPLACE FUNCTION outbox_publish_dead_summaries(
    p_tenant_id bigint, p_endpoint_uid text, p_endpoint_owner text, p_suppressed integer,
    p_owners jsonb, p_window_start timestamptz, p_now timestamptz
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    owners jsonb := coalesce(p_owners, '{}'::jsonb);
    unrecorded integer;
    item record;
    published integer := 0;
BEGIN
    -- counted before migration 0041, with no owner recorded: the endpoint's owner's
    SELECT p_suppressed - coalesce(sum(value::integer), 0) INTO unrecorded
    FROM jsonb_each_text(owners);
    IF unrecorded > 0 THEN
        owners := jsonb_set(
            owners, ARRAY[coalesce(p_endpoint_owner, '')],
            to_jsonb(coalesce((owners ->> coalesce(p_endpoint_owner, ''))::integer, 0)
                     + unrecorded));
    END IF;
    FOR item IN
        SELECT key, value::integer AS n FROM jsonb_each_text(owners)
        WHERE value::integer > 0 ORDER BY key
    LOOP
        PERFORM outbox_publish_operational(
            p_tenant_id, 'delivery.dead',
            jsonb_build_object('endpoint_id', p_endpoint_uid, 'summary', true,
                               'count', item.n, 'owner', nullif(item.key, ''),
                               'window_start', p_window_start,
                               'window_end', p_window_start + interval '1 minute'),
            'outbox:delivery.dead:summary:' || p_endpoint_uid || ':'
                || extract(epoch FROM p_window_start)::text
                || CASE WHEN item.key = '' THEN '' ELSE ':' || item.key END,
            p_now);
        published := published + 1;
    END LOOP;
    RETURN published;
END
$$
"""

# Called by the worker with the deliveries a batch made dead (as in 0009): per endpoint
# and minute the first `p_limit` are reported one by one, naming the owner; the rest are
# counted per owner and summarised once the minute is over.
DELIVERIES_DEAD = """
CREATE OR REPLACE FUNCTION outbox_deliveries_dead(
    p_ids bigint[], p_now timestamptz, p_limit integer
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    ep record;
    d record;
    mark record;
    owners jsonb;
    minute timestamptz := date_trunc('minute', p_now);
    sent integer := 0;
BEGIN
    FOR ep IN
        SELECT DISTINCT e.id, e.uid, e.tenant_id, e.owner
        FROM deliveries x JOIN endpoints e ON e.id = x.endpoint_id
        WHERE x.id = ANY(p_ids)
        ORDER BY e.id
    LOOP
        INSERT INTO operational_event_marks (endpoint_id, kind, window_start)
        VALUES (ep.id, 'delivery.dead', minute)
        ON CONFLICT (endpoint_id, kind) DO NOTHING;
        SELECT * INTO mark FROM operational_event_marks
        WHERE endpoint_id = ep.id AND kind = 'delivery.dead' FOR UPDATE;
        owners := coalesce(mark.suppressed_owners, '{}'::jsonb);
        IF mark.window_start < minute THEN
            IF mark.suppressed > 0 THEN
                PERFORM outbox_publish_dead_summaries(
                    ep.tenant_id, ep.uid, ep.owner, mark.suppressed, owners,
                    mark.window_start, p_now);
            END IF;
            mark.window_start := minute;
            mark.emitted := 0;
            mark.suppressed := 0;
            owners := '{}'::jsonb;
        END IF;
        FOR d IN
            SELECT x.id, x.attempts, x.final_reason, x.last_status_code, o.message_id,
                   o.event_type, coalesce(ep.owner, t.owner) AS owner
            FROM deliveries x
            JOIN outbox_events o ON o.id = x.event_id
            LEFT JOIN event_types t ON t.name = o.event_type
            WHERE x.id = ANY(p_ids) AND x.endpoint_id = ep.id AND x.state = 'dead'
              -- an operational event that died reports nothing: no event loops
              AND o.event_type <> ALL (outbox_operational_event_types())
            ORDER BY x.id
        LOOP
            IF mark.emitted < p_limit THEN
                PERFORM outbox_publish_operational(
                    ep.tenant_id, 'delivery.dead',
                    jsonb_build_object('endpoint_id', ep.uid, 'delivery_id', d.id,
                                       'message_id', d.message_id, 'event_type', d.event_type,
                                       'attempts', d.attempts, 'reason', d.final_reason,
                                       'last_status_code', d.last_status_code,
                                       'owner', d.owner),
                    'outbox:delivery.dead:' || d.id::text,
                    p_now);
                mark.emitted := mark.emitted + 1;
                sent := sent + 1;
            ELSE
                mark.suppressed := mark.suppressed + 1;
                owners := jsonb_set(
                    owners, ARRAY[coalesce(d.owner, '')],
                    to_jsonb(coalesce((owners ->> coalesce(d.owner, ''))::integer, 0) + 1));
            END IF;
        END LOOP;
        UPDATE operational_event_marks
        SET window_start = mark.window_start, emitted = mark.emitted,
            suppressed = mark.suppressed,
            suppressed_owners = CASE WHEN mark.suppressed > 0 THEN owners END
        WHERE endpoint_id = ep.id AND kind = 'delivery.dead';
    END LOOP;
    RETURN sent;
END
$$
"""

# The summaries of minutes that are over (the relay calls it), one per owner.
FLUSH_SUMMARIES = """
CREATE OR REPLACE FUNCTION outbox_flush_operational_summaries(p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    m record;
    flushed integer := 0;
BEGIN
    FOR m IN
        SELECT k.endpoint_id, k.window_start, k.suppressed, k.suppressed_owners, e.uid,
               e.tenant_id, e.owner
        FROM operational_event_marks k JOIN endpoints e ON e.id = k.endpoint_id
        WHERE k.suppressed > 0 AND k.window_start < date_trunc('minute', p_now)
        ORDER BY k.endpoint_id
        FOR UPDATE OF k SKIP LOCKED
    LOOP
        PERFORM outbox_publish_dead_summaries(
            m.tenant_id, m.uid, m.owner, m.suppressed, m.suppressed_owners, m.window_start,
            p_now);
        UPDATE operational_event_marks SET suppressed = 0, suppressed_owners = NULL
        WHERE endpoint_id = m.endpoint_id AND kind = 'delivery.dead';
        flushed := flushed + 1;
    END LOOP;
    RETURN flushed;
END
$$
"""


def _migration(name: str) -> ModuleType:
    """An earlier migration by file name (file names are not importable)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"outbox_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    # ADD COLUMN takes a brief ACCESS EXCLUSIVE lock: outbox.migrate runs it under a
    # short lock_timeout and retries. Only the workers' dead reports touch this table.
    op.add_column(
        "operational_event_marks",
        sa.Column("suppressed_owners", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.execute(PUBLISH_DEAD_SUMMARIES)
    op.execute(DELIVERIES_DEAD)
    op.execute(FLUSH_SUMMARIES)


def downgrade() -> None:
    op.execute(_migration("0031_hold_owners_thresholds.py")._dead_function(with_owner=True))
    flush = _migration("0009_contract.py").FLUSH_SUMMARIES
    op.execute(flush.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    op.execute(
        "DROP FUNCTION outbox_publish_dead_summaries("
        "bigint, text, text, integer, jsonb, timestamptz, timestamptz)"
    )
    op.drop_column("operational_event_marks", "suppressed_owners")
