"""The lock that lets one `outbox migrate` run at a time (outbox/migrate.py)."""

from __future__ import annotations

from sqlalchemy import text

# A session-level advisory lock: one `outbox migrate` at a time per database (two deploy
# jobs starting at once). Tried, never waited for inside a transaction: a waiting
# transaction would hold a snapshot that the other run's CONCURRENTLY build waits out.
MIGRATION_LOCK_KEY = 0x6F7574626F78  # "outbox"

# Take the lock if free, at once (False: another run holds it).
TRY_MIGRATION_LOCK = text("SELECT pg_try_advisory_lock(:key)").bindparams(key=MIGRATION_LOCK_KEY)

# Give the lock back when the run ends.
RELEASE_MIGRATION_LOCK = text("SELECT pg_advisory_unlock(:key)").bindparams(key=MIGRATION_LOCK_KEY)

# Who holds it: a bigint key is stored as classid (high half) and objid (low half).
MIGRATION_LOCK_HOLDER = text(
    """
    SELECT pid FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND (classid::bigint << 32) + objid::bigint = :key
    """
).bindparams(key=MIGRATION_LOCK_KEY)
