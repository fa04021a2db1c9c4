"""contract: event-type catalogue, SQL publish function, ed25519 scheme, operational events

- `event_types` and `event_type_versions`: the catalogue with versioned JSON Schemas.
- `outbox_events.validate_pending` / `rejected_at` / `rejected_reason`: events written by
  the SQL function are checked against their schema by the relay; a payload that breaks
  it is rejected (not sent) and can be requeued.
- `endpoints.signature_scheme`: 'hmac' (v1) or 'ed25519' (v1a), and the `whpk_` public key.
- `outbox_publish(...)`: publishing from any language, in the caller's transaction.
- Operational events (`endpoint.disabled`, `endpoint.breaker_opened`, `endpoint.recovered`,
  `delivery.dead`, `tenant.disabled`) are written in the same transaction as the change
  they report: triggers for the state changes, `outbox_deliveries_dead()` for dead
  deliveries (the worker calls it with its batch), with storm bounds kept in
  `operational_event_marks`.

Revision ID: 0009
Revises: 0014
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0014"
branch_labels = None
depends_on = None

OPERATIONAL_TYPES = (
    "'endpoint.disabled', 'endpoint.breaker_opened', 'endpoint.recovered', "
    "'delivery.dead', 'tenant.disabled'"
)

# msg_ + a UUIDv7 in hex, the same shape as outbox.ids.new_message_id().
NEW_MESSAGE_ID = """
CREATE FUNCTION outbox_new_message_id() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ms bigint := floor(extract(epoch FROM clock_timestamp()) * 1000);
    r text := replace(gen_random_uuid()::text, '-', '');
BEGIN
    RETURN 'msg_' || lpad(to_hex(ms), 12, '0') || '7' || substr(r, 1, 3)
        || to_hex(8 + (('x' || substr(r, 4, 1))::bit(4)::int & 3)) || substr(r, 5, 15);
END
$$
"""

# The one insert every operational event goes through: routed to the owning tenant,
# deduplicated by its key, and waking an idle relay like publish() does.
PUBLISH_OPERATIONAL = """
CREATE FUNCTION outbox_publish_operational(
    p_tenant_id bigint, p_event_type text, p_payload jsonb, p_key text, p_at timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    idle boolean := NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL);
    inserted text;
BEGIN
    INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, idempotency_key,
                               priority, created_at)
    VALUES (outbox_new_message_id(), p_tenant_id, p_event_type, p_payload, p_key,
            COALESCE((SELECT priority FROM event_type_priorities
                      WHERE event_type = p_event_type), 0),
            -- the time of the change it reports (the service's injected clock), not now()
            COALESCE(p_at, now()))
    ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING message_id INTO inserted;
    IF inserted IS NOT NULL AND idle THEN
        PERFORM pg_notify('outbox_events', '');
    END IF;
END
$$
"""

PUBLISH = f"""
CREATE FUNCTION outbox_publish(
    p_tenant text,
    p_event_type text,
    p_payload jsonb,
    p_idempotency_key text DEFAULT NULL,
    p_ordering_key text DEFAULT NULL,
    p_priority integer DEFAULT NULL,
    p_max_payload_bytes integer DEFAULT 65536
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_tenant bigint;
    type_status text;
    size integer;
    idle boolean;
    found_id text;
BEGIN
    IF p_event_type IS NULL
       OR p_event_type !~ '^[A-Za-z0-9][A-Za-z0-9_-]*([.][A-Za-z0-9][A-Za-z0-9_-]*)*$'
       OR length(p_event_type) > 200 THEN
        RAISE EXCEPTION 'outbox_publish: event type % is invalid', quote_nullable(p_event_type)
            USING ERRCODE = '22023',
                  HINT = 'use dot-separated words of letters, digits, _ or -, e.g. order.created';
    END IF;
    IF p_event_type IN ({OPERATIONAL_TYPES}) THEN
        RAISE EXCEPTION 'outbox_publish: % is an operational event the service publishes itself',
            p_event_type USING ERRCODE = '22023', HINT = 'choose another event type';
    END IF;
    IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' THEN
        RAISE EXCEPTION 'outbox_publish: payload must be a JSON object, not %',
            coalesce(jsonb_typeof(p_payload), 'NULL')
            USING ERRCODE = '22023', HINT = 'pass a jsonb object such as ''{{"id": 1}}''';
    END IF;
    size := octet_length(p_payload::text);
    IF size > p_max_payload_bytes THEN
        RAISE EXCEPTION 'outbox_publish: payload is % bytes, over the %-byte limit',
            size, p_max_payload_bytes
            USING ERRCODE = '22023', HINT = 'send ids and let the receiver fetch the rest';
    END IF;
    IF (p_idempotency_key IS NOT NULL AND length(p_idempotency_key) NOT BETWEEN 1 AND 255)
       OR (p_ordering_key IS NOT NULL AND length(p_ordering_key) NOT BETWEEN 1 AND 255) THEN
        RAISE EXCEPTION 'outbox_publish: keys must be non-empty and at most 255 characters'
            USING ERRCODE = '22023';
    END IF;
    IF p_priority IS NOT NULL AND p_priority NOT BETWEEN -100 AND 100 THEN
        RAISE EXCEPTION 'outbox_publish: priority % is outside -100..100', p_priority
            USING ERRCODE = '22023', HINT = 'higher goes first; NULL uses the type default';
    END IF;
    SELECT id INTO v_tenant FROM tenants WHERE uid = coalesce(p_tenant, 'default');
    IF v_tenant IS NULL THEN
        RAISE EXCEPTION 'outbox_publish: unknown tenant %', quote_literal(p_tenant)
            USING ERRCODE = '22023',
                  HINT = 'create it first (outbox tenants add), or pass NULL for the default';
    END IF;
    SELECT status INTO type_status FROM event_types WHERE name = p_event_type;
    IF type_status = 'archived' THEN
        RAISE EXCEPTION 'outbox_publish: event type % is archived', p_event_type
            USING ERRCODE = '22023', HINT = 'publish its successor instead';
    END IF;
    idle := NOT EXISTS (SELECT 1 FROM outbox_events WHERE relayed_at IS NULL);
    INSERT INTO outbox_events AS o
        (message_id, tenant_id, event_type, payload, idempotency_key, ordering_key, priority,
         validate_pending)
    VALUES (outbox_new_message_id(), v_tenant, p_event_type, p_payload, p_idempotency_key,
            p_ordering_key,
            COALESCE(p_priority, (SELECT p.priority FROM event_type_priorities p
                                  WHERE p.event_type = p_event_type), 0),
            true)
    ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING message_id INTO found_id;
    IF found_id IS NOT NULL THEN
        IF idle THEN
            PERFORM pg_notify('outbox_events', '');
        END IF;
        RETURN found_id;
    END IF;
    SELECT message_id INTO found_id FROM outbox_events o
    WHERE o.tenant_id = v_tenant AND o.idempotency_key = p_idempotency_key;
    RETURN found_id;
END
$$
"""  # noqa: S608 - constant fragments only

ENDPOINT_DISABLED = """
CREATE FUNCTION outbox_endpoint_disabled_event() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox_publish_operational(
        NEW.tenant_id, 'endpoint.disabled',
        jsonb_build_object('endpoint_id', NEW.uid, 'url', NEW.url,
                           'reason', NEW.disabled_reason, 'disabled_at', NEW.disabled_at),
        'outbox:endpoint.disabled:' || NEW.uid || ':'
            || extract(epoch FROM coalesce(NEW.disabled_at, now()))::text,
        NEW.disabled_at);
    RETURN NULL;
END
$$
"""

TENANT_DISABLED = """
CREATE FUNCTION outbox_tenant_disabled_event() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox_publish_operational(
        NEW.id, 'tenant.disabled',
        jsonb_build_object('tenant_id', NEW.uid, 'reason', NEW.disabled_reason,
                           'disabled_at', NEW.disabled_at),
        'outbox:tenant.disabled:' || NEW.uid || ':'
            || extract(epoch FROM coalesce(NEW.disabled_at, now()))::text,
        NEW.disabled_at);
    RETURN NULL;
END
$$
"""

# breaker_opened: only on a real trip (trips grows; re-enabling also sets 'open' but resets
# trips), and at most one per endpoint per cooldown. recovered: open/half-open -> closed.
BREAKER_CHANGED = """
CREATE FUNCTION outbox_breaker_event() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ep record;
    last_sent timestamptz;
BEGIN
    SELECT uid, tenant_id INTO ep FROM endpoints WHERE id = NEW.endpoint_id;
    IF NEW.breaker_state = 'open' AND NEW.trips > OLD.trips THEN
        SELECT window_start INTO last_sent FROM operational_event_marks
        WHERE endpoint_id = NEW.endpoint_id AND kind = 'endpoint.breaker_opened';
        IF last_sent IS NOT NULL
           AND last_sent > NEW.opened_at - (NEW.open_until - NEW.opened_at) THEN
            RETURN NULL;
        END IF;
        INSERT INTO operational_event_marks (endpoint_id, kind, window_start, emitted)
        VALUES (NEW.endpoint_id, 'endpoint.breaker_opened', NEW.opened_at, 1)
        ON CONFLICT (endpoint_id, kind) DO UPDATE
        SET window_start = EXCLUDED.window_start,
            emitted = operational_event_marks.emitted + 1;
        PERFORM outbox_publish_operational(
            ep.tenant_id, 'endpoint.breaker_opened',
            jsonb_build_object('endpoint_id', ep.uid, 'opened_at', NEW.opened_at,
                               'open_until', NEW.open_until,
                               'consecutive_failures', NEW.consecutive_failures,
                               'last_failure', NEW.last_failure),
            'outbox:endpoint.breaker_opened:' || ep.uid || ':'
                || extract(epoch FROM NEW.opened_at)::text,
            NEW.opened_at);
    ELSIF NEW.breaker_state = 'closed' AND OLD.breaker_state IN ('open', 'half_open') THEN
        PERFORM outbox_publish_operational(
            ep.tenant_id, 'endpoint.recovered',
            jsonb_build_object('endpoint_id', ep.uid, 'recovered_at', NEW.updated_at),
            'outbox:endpoint.recovered:' || ep.uid || ':'
                || extract(epoch FROM NEW.updated_at)::text,
            NEW.updated_at);
    END IF;
    RETURN NULL;
END
$$
"""

_SUMMARY = """
        PERFORM outbox_publish_operational(
            {tenant}, 'delivery.dead',
            jsonb_build_object('endpoint_id', {uid}, 'summary', true, 'count', {count},
                               'window_start', {start},
                               'window_end', {start} + interval '1 minute'),
            'outbox:delivery.dead:summary:' || {uid} || ':' || extract(epoch FROM {start})::text,
            p_now);
"""

# Called by the worker with the deliveries a batch made dead. Per endpoint and minute the
# first `p_limit` are reported one by one, the rest in one summary once the minute is over
# (here, when the next one dies, or by outbox_flush_operational_summaries()). Endpoints
# are visited in id order, so concurrent workers lock the marks in the same order.
DELIVERIES_DEAD = f"""
CREATE FUNCTION outbox_deliveries_dead(p_ids bigint[], p_now timestamptz, p_limit integer)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    ep record;
    d record;
    mark record;
    minute timestamptz := date_trunc('minute', p_now);
    sent integer := 0;
BEGIN
    FOR ep IN
        SELECT DISTINCT e.id, e.uid, e.tenant_id
        FROM deliveries x JOIN endpoints e ON e.id = x.endpoint_id
        WHERE x.id = ANY(p_ids)
        ORDER BY e.id
    LOOP
        INSERT INTO operational_event_marks (endpoint_id, kind, window_start)
        VALUES (ep.id, 'delivery.dead', minute)
        ON CONFLICT (endpoint_id, kind) DO NOTHING;
        SELECT * INTO mark FROM operational_event_marks
        WHERE endpoint_id = ep.id AND kind = 'delivery.dead' FOR UPDATE;
        IF mark.window_start < minute THEN
            IF mark.suppressed > 0 THEN
{
    _SUMMARY.format(
        tenant="ep.tenant_id", uid="ep.uid", count="mark.suppressed", start="mark.window_start"
    )
}
            END IF;
            mark.window_start := minute;
            mark.emitted := 0;
            mark.suppressed := 0;
        END IF;
        FOR d IN
            SELECT x.id, x.attempts, x.final_reason, x.last_status_code, o.message_id,
                   o.event_type
            FROM deliveries x JOIN outbox_events o ON o.id = x.event_id
            WHERE x.id = ANY(p_ids) AND x.endpoint_id = ep.id AND x.state = 'dead'
              -- an operational event that died reports nothing: no event loops
              AND o.event_type NOT IN ({OPERATIONAL_TYPES})
            ORDER BY x.id
        LOOP
            IF mark.emitted < p_limit THEN
                PERFORM outbox_publish_operational(
                    ep.tenant_id, 'delivery.dead',
                    jsonb_build_object('endpoint_id', ep.uid, 'delivery_id', d.id,
                                       'message_id', d.message_id, 'event_type', d.event_type,
                                       'attempts', d.attempts, 'reason', d.final_reason,
                                       'last_status_code', d.last_status_code),
                    'outbox:delivery.dead:' || d.id::text,
                    p_now);
                mark.emitted := mark.emitted + 1;
                sent := sent + 1;
            ELSE
                mark.suppressed := mark.suppressed + 1;
            END IF;
        END LOOP;
        UPDATE operational_event_marks
        SET window_start = mark.window_start, emitted = mark.emitted,
            suppressed = mark.suppressed
        WHERE endpoint_id = ep.id AND kind = 'delivery.dead';
    END LOOP;
    RETURN sent;
END
$$
"""  # noqa: S608 - constant fragments only

FLUSH_SUMMARIES = f"""
CREATE FUNCTION outbox_flush_operational_summaries(p_now timestamptz) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    m record;
    flushed integer := 0;
BEGIN
    FOR m IN
        SELECT k.endpoint_id, k.window_start, k.suppressed, e.uid, e.tenant_id
        FROM operational_event_marks k JOIN endpoints e ON e.id = k.endpoint_id
        WHERE k.suppressed > 0 AND k.window_start < date_trunc('minute', p_now)
        ORDER BY k.endpoint_id
        FOR UPDATE OF k SKIP LOCKED
    LOOP
{_SUMMARY.format(tenant="m.tenant_id", uid="m.uid", count="m.suppressed", start="m.window_start")}
        UPDATE operational_event_marks SET suppressed = 0
        WHERE endpoint_id = m.endpoint_id AND kind = 'delivery.dead';
        flushed := flushed + 1;
    END LOOP;
    RETURN flushed;
END
$$
"""  # noqa: S608 - constant fragments only

TRIGGERS = (
    """
    CREATE TRIGGER outbox_endpoint_disabled AFTER UPDATE OF enabled ON endpoints
    FOR EACH ROW WHEN (OLD.enabled AND NOT NEW.enabled)
    EXECUTE FUNCTION outbox_endpoint_disabled_event()
    """,
    """
    CREATE TRIGGER outbox_tenant_disabled AFTER UPDATE OF enabled ON tenants
    FOR EACH ROW WHEN (OLD.enabled AND NOT NEW.enabled)
    EXECUTE FUNCTION outbox_tenant_disabled_event()
    """,
    """
    CREATE TRIGGER outbox_breaker_changed AFTER UPDATE OF breaker_state ON endpoint_health
    FOR EACH ROW WHEN (OLD.breaker_state IS DISTINCT FROM NEW.breaker_state)
    EXECUTE FUNCTION outbox_breaker_event()
    """,
)

FUNCTIONS = (
    NEW_MESSAGE_ID,
    PUBLISH_OPERATIONAL,
    PUBLISH,
    ENDPOINT_DISABLED,
    TENANT_DISABLED,
    BREAKER_CHANGED,
    DELIVERIES_DEAD,
    FLUSH_SUMMARIES,
)


def _now(name: str) -> sa.Column[object]:
    return sa.Column(
        name, sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "event_types",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'active'"), nullable=False),
        sa.Column("current_version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column(
            "revision",
            sa.Text(),
            server_default=sa.text("(gen_random_uuid())::text"),
            nullable=False,
        ),
        _now("created_at"),
        _now("updated_at"),
        sa.CheckConstraint(
            "status IN ('active', 'deprecated', 'archived')",
            name=op.f("ck_event_types_known_status"),
        ),
        sa.CheckConstraint(
            "name ~ '^[A-Za-z0-9][A-Za-z0-9_-]*([.][A-Za-z0-9][A-Za-z0-9_-]*)*$'"
            " AND length(name) <= 200",
            name=op.f("ck_event_types_name_format"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_types")),
        sa.UniqueConstraint("name", name=op.f("uq_event_types_name")),
    )
    op.create_table(
        "event_type_versions",
        sa.Column("event_type_id", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("schema", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("example", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        _now("created_at"),
        sa.ForeignKeyConstraint(
            ["event_type_id"],
            ["event_types.id"],
            name=op.f("fk_event_type_versions_event_type_id_event_types"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("event_type_id", "version", name=op.f("pk_event_type_versions")),
    )
    op.create_table(
        "operational_event_marks",
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("emitted", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("suppressed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["endpoints.id"],
            name=op.f("fk_operational_event_marks_endpoint_id_endpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("endpoint_id", "kind", name=op.f("pk_operational_event_marks")),
    )
    op.create_index(
        "ix_operational_event_marks_suppressed",
        "operational_event_marks",
        ["window_start"],
        postgresql_where=sa.text("suppressed > 0"),
    )
    for column in (
        sa.Column(
            "validate_pending", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("rejected_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rejected_reason", sa.Text(), nullable=True),
    ):
        op.add_column("outbox_events", column)
    op.create_index(
        "ix_outbox_events_validate_pending",
        "outbox_events",
        ["id"],
        postgresql_where=sa.text("relayed_at IS NULL AND validate_pending"),
    )
    op.create_index(
        "ix_outbox_events_rejected",
        "outbox_events",
        ["id"],
        postgresql_where=sa.text("rejected_at IS NOT NULL"),
    )
    op.add_column(
        "endpoints",
        sa.Column("signature_scheme", sa.Text(), server_default=sa.text("'hmac'"), nullable=False),
    )
    op.add_column("endpoints", sa.Column("signing_public_key", sa.Text(), nullable=True))
    op.create_check_constraint(
        op.f("ck_endpoints_known_signature_scheme"),
        "endpoints",
        "signature_scheme IN ('hmac', 'ed25519')",
    )
    for statement in (*FUNCTIONS, *TRIGGERS):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER outbox_breaker_changed ON endpoint_health")
    op.execute("DROP TRIGGER outbox_tenant_disabled ON tenants")
    op.execute("DROP TRIGGER outbox_endpoint_disabled ON endpoints")
    for name in (
        "outbox_flush_operational_summaries(timestamptz)",
        "outbox_deliveries_dead(bigint[], timestamptz, integer)",
        "outbox_breaker_event()",
        "outbox_tenant_disabled_event()",
        "outbox_endpoint_disabled_event()",
        "outbox_publish(text, text, jsonb, text, text, integer, integer)",
        "outbox_publish_operational(bigint, text, jsonb, text, timestamptz)",
        "outbox_new_message_id()",
    ):
        op.execute(f"DROP FUNCTION {name}")
    op.drop_constraint(op.f("ck_endpoints_known_signature_scheme"), "endpoints", type_="check")
    op.drop_column("endpoints", "signing_public_key")
    op.drop_column("endpoints", "signature_scheme")
    op.drop_index("ix_outbox_events_rejected", table_name="outbox_events")
    op.drop_index("ix_outbox_events_validate_pending", table_name="outbox_events")
    for name in ("rejected_reason", "rejected_at", "validate_pending"):
        op.drop_column("outbox_events", name)
    op.drop_index("ix_operational_event_marks_suppressed", table_name="operational_event_marks")
    op.drop_table("operational_event_marks")
    op.drop_table("event_type_versions")
    op.drop_table("event_types")
