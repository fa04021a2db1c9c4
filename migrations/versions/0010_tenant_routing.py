"""tenant routing index, tenant token buckets, in-flight per tenant

`endpoint_subscriptions` indexes (pattern, tenant) -> endpoint for the relay, kept in
step with `endpoints` by a trigger (so every writer is covered, SQL by hand included);
`tenant_buckets` holds the token bucket of tenants capped per second; a partial index
counts a tenant's in-flight deliveries for its max_in_flight cap.

Revision ID: 0010
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0007"
branch_labels = None
depends_on = None

# Re-derive an endpoint's rows from its current patterns. The patterns are distinct
# (parse_event_patterns), but DISTINCT keeps hand-written duplicates harmless.
_SYNC_FUNCTION = """
CREATE FUNCTION outbox_sync_endpoint_subscriptions() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        DELETE FROM endpoint_subscriptions WHERE endpoint_id = OLD.id;
    END IF;
    INSERT INTO endpoint_subscriptions (endpoint_id, pattern, tenant_id)
    SELECT DISTINCT NEW.id, p.pattern, CASE WHEN NEW.all_tenants THEN NULL ELSE NEW.tenant_id END
    FROM unnest(NEW.event_types) AS p(pattern);
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "endpoint_subscriptions",
        sa.Column("endpoint_id", sa.BigInteger(), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["endpoints.id"],
            name=op.f("fk_endpoint_subscriptions_endpoint_id_endpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("endpoint_id", "pattern", name=op.f("pk_endpoint_subscriptions")),
    )
    op.create_index(
        op.f("ix_endpoint_subscriptions_pattern_tenant_id"),
        "endpoint_subscriptions",
        ["pattern", "tenant_id"],
    )
    op.execute(_SYNC_FUNCTION)
    op.execute(
        """
        CREATE TRIGGER endpoints_subscriptions_on_insert
        AFTER INSERT ON endpoints
        FOR EACH ROW EXECUTE FUNCTION outbox_sync_endpoint_subscriptions()
        """
    )
    # Only a real change re-derives the rows (UPDATE_ENDPOINT always names event_types).
    op.execute(
        """
        CREATE TRIGGER endpoints_subscriptions_on_update
        AFTER UPDATE OF event_types, tenant_id, all_tenants ON endpoints
        FOR EACH ROW
        WHEN (OLD.event_types IS DISTINCT FROM NEW.event_types
              OR OLD.tenant_id IS DISTINCT FROM NEW.tenant_id
              OR OLD.all_tenants IS DISTINCT FROM NEW.all_tenants)
        EXECUTE FUNCTION outbox_sync_endpoint_subscriptions()
        """
    )
    op.execute(
        """
        INSERT INTO endpoint_subscriptions (endpoint_id, pattern, tenant_id)
        SELECT DISTINCT e.id, p.pattern, CASE WHEN e.all_tenants THEN NULL ELSE e.tenant_id END
        FROM endpoints e, unnest(e.event_types) AS p(pattern)
        """
    )
    op.create_table(
        "tenant_buckets",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("tokens_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_buckets_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_buckets")),
    )
    op.create_index(
        op.f("ix_deliveries_tenant_id_in_flight"),
        "deliveries",
        ["tenant_id"],
        postgresql_where=sa.text("state = 'in_flight'"),
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_deliveries_tenant_id_in_flight"), table_name="deliveries")
    op.drop_table("tenant_buckets")
    op.execute("DROP TRIGGER endpoints_subscriptions_on_update ON endpoints")
    op.execute("DROP TRIGGER endpoints_subscriptions_on_insert ON endpoints")
    # the single trigger of this migration's first version, on databases migrated with it
    op.execute("DROP TRIGGER IF EXISTS endpoints_sync_subscriptions ON endpoints")
    op.execute("DROP FUNCTION outbox_sync_endpoint_subscriptions()")
    op.drop_table("endpoint_subscriptions")
