"""outbox_publish(): NULL limits mean the defaults, and no caller exceeds the ceilings

`outbox_publish(..., max_payload_bytes => NULL)` compared every size with NULL, which is
never true: the size limit was gone (two 100 MB events went through). A NULL depth was
refused, though `NULL` means "the default" everywhere else. Now NULL is the default
(65536 bytes, 64 levels, publish()'s), and a caller's limit above the server's ceiling is
refused with an error naming it. The ceilings are `outbox_publish_limits()` (1 MiB and
256 levels): a DBA who needs more replaces that function; a caller cannot.

Online: CREATE OR REPLACE keeps the function's signature, grants and callers; the only
lock is the function's own catalogue row, under a short lock_timeout.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

LIMITS = """
CREATE OR REPLACE FUNCTION outbox_publish_limits(
    OUT max_payload_bytes integer, OUT max_payload_depth integer
)
LANGUAGE sql IMMUTABLE AS $$ SELECT 1048576, 256 $$
"""

OLD_RANGE_CHECK = (
    "    IF p_max_payload_depth IS NULL OR p_max_payload_depth NOT BETWEEN 1 AND 256 THEN\n"
    "        RAISE EXCEPTION 'outbox_publish: max_payload_depth must be from 1 to 256'\n"
    "            USING ERRCODE = '22023';\n"
    "    END IF;\n"
)

NEW_RANGE_CHECK = """    SELECT l.max_payload_bytes, l.max_payload_depth INTO ceiling_bytes, ceiling_depth
    FROM outbox_publish_limits() l;
    p_max_payload_bytes := coalesce(p_max_payload_bytes, 65536);
    p_max_payload_depth := coalesce(p_max_payload_depth, 64);
    IF p_max_payload_bytes NOT BETWEEN 1 AND ceiling_bytes THEN
        RAISE EXCEPTION 'outbox_publish: max_payload_bytes % is outside 1..% (the server''s ceiling)',
            p_max_payload_bytes, ceiling_bytes
            USING ERRCODE = '22023',
                  HINT = 'pass NULL for the default (65536) or a smaller limit; '
                         'a DBA raises the ceiling by replacing outbox_publish_limits()';
    END IF;
    IF p_max_payload_depth NOT BETWEEN 1 AND ceiling_depth THEN
        RAISE EXCEPTION 'outbox_publish: max_payload_depth % is outside 1..% (the server''s ceiling)',
            p_max_payload_depth, ceiling_depth
            USING ERRCODE = '22023',
                  HINT = 'pass NULL for the default (64) or a smaller limit';
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


def _replaceable(source: str) -> str:
    if source.count("CREATE FUNCTION outbox_publish(") != 1:
        raise RuntimeError("migration 0021: outbox_publish() is not defined once")
    return source.replace(
        "CREATE FUNCTION outbox_publish(", "CREATE OR REPLACE FUNCTION outbox_publish("
    )


def _previous() -> str:
    """The function as migration 0017 left it."""
    depth = _migration("0017_publish_depth.py")
    return _replaceable(depth._with_depth_check(depth._contract().PUBLISH))


def _with_ceilings(old: str) -> str:
    if old.count(OLD_RANGE_CHECK) != 1 or old.count("    depth integer;\n") != 1:
        raise RuntimeError("migration 0021: outbox_publish() is not the one 0017 installed")
    new = old.replace(OLD_RANGE_CHECK, NEW_RANGE_CHECK)
    return new.replace(
        "    depth integer;\n",
        "    depth integer;\n    ceiling_bytes integer;\n    ceiling_depth integer;\n",
    )


def upgrade() -> None:
    # outbox.migrate holds every migration to a short lock_timeout and retries.
    op.execute(LIMITS)
    op.execute(_with_ceilings(_previous()))


def downgrade() -> None:
    op.execute(_previous())
    op.execute("DROP FUNCTION outbox_publish_limits()")
