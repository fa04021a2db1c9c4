"""deliveries and outbox_events keep room on each page for their rows' next versions

A delivery's row is written three times (the relay's insert, the claim, the outcome) and
an event's twice (publish, then the relay's relayed_at). None of those updates can be
HOT (each changes a column of an index predicate), so each writes its index entries
whatever the page. What room on the page saves is the rest: a new version on its old
one's page is logged as the changed bytes only, with one page reference instead of two,
and needs no other page found, locked and extended (docs/scaling.md, "HOT updates and
fillfactor", has the measured pairs).

How much room: a relay pass updates every event of a page in one transaction, so each
page must hold two versions of all its events (50). A claim updates every due delivery
of a page in one transaction and its version is the larger one (it adds the lease and
the worker's id), so deliveries keep 60 % free (40); the outcome's version then fits in
the room the insert's left once that is pruned.

A storage parameter only: ALTER TABLE ... SET (fillfactor) takes SHARE UPDATE
EXCLUSIVE (publishing, relaying, claiming and recording go on), rewrites nothing, and
applies to pages filled from now on; existing pages stay as they are.

Revision ID: 0047
Revises: 0046
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0047"
down_revision = "0046"
branch_labels = None
depends_on = None

# (the values outbox/schema.py declares; a migration does not import the code's)
FILLFACTORS = {"deliveries": 40, "outbox_events": 50}


def upgrade() -> None:
    for table, fillfactor in FILLFACTORS.items():
        op.execute(f"ALTER TABLE {table} SET (fillfactor = {fillfactor})")


def downgrade() -> None:
    for table in FILLFACTORS:
        op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
