"""${message}

Online? Say what it locks and for how long per million rows (README, "Upgrading").
The runner (outbox/migrate.py) gives each migration its own transaction under a short
lock_timeout and starts it over when a lock is not had, so: indexes CONCURRENTLY inside
`with op.get_context().autocommit_block():` with if_not_exists/if_exists (see 0020,
which also drops an INVALID leftover first); columns nullable or with a constant
default; NOT NULL and foreign keys via NOT VALID + VALIDATE; the previous release must
keep working on the result (tests/project/test_upgrade.py); squawk must pass
(tests/project/test_migration_lint.py); one transaction blocks at most one of the
running service's tables, the others each in a statement of their own in an autocommit
block (tests/outbox/test_migration_locks.py; see 0025, 0031).

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
