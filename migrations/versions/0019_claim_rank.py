"""Nothing since 0.2.0 (0020 builds its indexes online); was: the due indexes end with `id`

A claim takes each endpoint's due rows, and ranks endpoints by their heads, in
(priority, due time, id) order. Rows due at the same moment (a relay batch shares one
timestamp) were in heap order in both indexes, so an endpoint's "head" depended on where
its rows happened to be stored, and a claim sorted every row of that moment to take a few.
With `id` last, both indexes hold the claim's order: an endpoint's head is its first due
row in that order, and a claim among many tenants finds the batch by walking
ix_deliveries_due from the front (delivery/queries.py, RANK_CLAIM_GATES).

Since 0.2.0 this migration does nothing; 0020 builds the same indexes concurrently
(see upgrade() below for why).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Nothing, on purpose: 0020 builds these indexes online.

    This migration used to drop and re-create both indexes with a plain CREATE INDEX,
    in the transaction of every other pending migration: on a live table that blocks
    the relay's inserts and every worker's updates for the whole build, and the claim
    has no index between the drop and the create. A database already at 0019 has the
    indexes (0020 rebuilds them concurrently under new names); one still at 0018 gets
    them from 0020 the same way.
    """


def downgrade() -> None:
    """Nothing: 0019 changes nothing any more (0020's downgrade restores 0019's indexes)."""
