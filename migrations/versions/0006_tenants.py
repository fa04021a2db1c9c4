"""tenants: every endpoint, event and delivery belongs to one; the default tenant

Existing rows move to the tenant 'default', so a single-tenant installation keeps
working unchanged: publish() without a tenant and endpoints added without one use it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_OWNED = ("outbox_events", "endpoints", "deliveries")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("uid", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column(
            "metadata",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.Column("max_per_second", sa.Float(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("uid ~ '^[^[:cntrl:]]{1,255}$'", name=op.f("ck_tenants_uid_format")),
        sa.CheckConstraint(
            "enabled OR disabled_reason IS NOT NULL", name=op.f("ck_tenants_disabled_has_reason")
        ),
        sa.CheckConstraint(
            "(max_in_flight IS NULL OR max_in_flight > 0)"
            " AND (max_per_second IS NULL OR max_per_second > 0)",
            name=op.f("ck_tenants_positive_limits"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("uid", name=op.f("uq_tenants_uid")),
    )
    insert_default = "INSERT INTO tenants (uid, name) VALUES ('default', 'Default tenant')"
    if op.get_context().as_sql:
        # Offline SQL (`outbox migrate --sql`) cannot read the id back; the table was
        # created just above, so its identity hands out 1 first.
        op.execute(insert_default)
        default_id = 1
    else:
        default_id = op.get_bind().execute(sa.text(insert_default + " RETURNING id")).scalar_one()
    for table in _OWNED:
        # A constant default fills existing rows without rewriting the table; it is dropped
        # at once, so every new row must name its tenant.
        op.add_column(
            table,
            sa.Column(
                "tenant_id",
                sa.BigInteger(),
                server_default=sa.text(str(default_id)),
                nullable=False,
            ),
        )
        op.alter_column(table, "tenant_id", server_default=None)
        op.create_foreign_key(
            op.f(f"fk_{table}_tenant_id_tenants"),
            table,
            "tenants",
            ["tenant_id"],
            ["id"],
            ondelete="CASCADE",
        )
    op.add_column(
        "endpoints",
        sa.Column("all_tenants", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.create_index(op.f("ix_endpoints_tenant_id"), "endpoints", ["tenant_id"])
    op.create_index(op.f("ix_deliveries_tenant_id_id"), "deliveries", ["tenant_id", "id"])
    op.drop_index("uq_outbox_events_idempotency_key", table_name="outbox_events")
    op.create_index(
        "uq_outbox_events_tenant_id_idempotency_key",
        "outbox_events",
        ["tenant_id", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.add_column("admin_tokens", sa.Column("tenant_uid", sa.Text(), nullable=True))
    op.add_column("audit_log", sa.Column("tenant_uid", sa.Text(), nullable=True))
    op.create_index(op.f("ix_audit_log_tenant_uid_at"), "audit_log", ["tenant_uid", "at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_log_tenant_uid_at"), table_name="audit_log")
    op.drop_column("audit_log", "tenant_uid")
    op.drop_column("admin_tokens", "tenant_uid")
    op.drop_index("uq_outbox_events_tenant_id_idempotency_key", table_name="outbox_events")
    # Keys unique per tenant may repeat across tenants; the old global index needs them unique.
    op.execute(
        "UPDATE outbox_events o SET idempotency_key = NULL FROM outbox_events d"
        " WHERE d.idempotency_key = o.idempotency_key AND d.id < o.id"
    )
    op.create_index(
        "uq_outbox_events_idempotency_key",
        "outbox_events",
        ["idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_index(op.f("ix_deliveries_tenant_id_id"), table_name="deliveries")
    op.drop_index(op.f("ix_endpoints_tenant_id"), table_name="endpoints")
    op.drop_column("endpoints", "all_tenants")
    for table in reversed(_OWNED):
        op.drop_constraint(op.f(f"fk_{table}_tenant_id_tenants"), table, type_="foreignkey")
        op.drop_column(table, "tenant_id")
    op.drop_table("tenants")
