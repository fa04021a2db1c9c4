"""outbox_publish(): refuse payloads nested deeper than max_payload_depth (default 64)

publish() refuses them in Python; the SQL function did not, and one event nested a few
thousand levels deep (jsonb stores it) could not be read back by the relay's schema
check, which then failed on every batch: no event of any tenant went out. The function
gains `max_payload_depth integer DEFAULT 64` (publish()'s default); callers that pass
seven arguments or fewer keep working.

Revision ID: 0017
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0017"
down_revision = "0011"
branch_labels = None
depends_on = None

OLD_SIGNATURE = "outbox_publish(text, text, jsonb, text, text, integer, integer)"
NEW_SIGNATURE = "outbox_publish(text, text, jsonb, text, text, integer, integer, integer)"

# Nesting depth without recursion: drop string literals (brackets inside them do not
# count), keep only brackets, then peel the innermost pairs off once per level. Each pass
# is one regexp over the text, and it stops one level past the limit.
DEPTH_CHECK = """
    shape := regexp_replace(
        regexp_replace(p_payload::text, '"(?:[^"\\\\]|\\\\.)*"', '', 'g'), '[^][{}]', '', 'g');
    depth := 0;
    WHILE shape <> '' LOOP
        depth := depth + 1;
        IF depth > p_max_payload_depth THEN
            RAISE EXCEPTION 'outbox_publish: payload nests deeper than % levels',
                p_max_payload_depth
                USING ERRCODE = '22023',
                      HINT = 'flatten it, or pass a larger max_payload_depth (at most 256)';
        END IF;
        shape := regexp_replace(shape, '\\[\\]|\\{\\}', '', 'g');
    END LOOP;
"""


def _contract() -> ModuleType:
    """Migration 0009, which holds the function as it was (file names are not importable)."""
    path = Path(__file__).with_name("0009_contract.py")
    spec = importlib.util.spec_from_file_location("outbox_migration_0009", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"migration 0017: {old.strip()!r} is not once in outbox_publish()")
    return source.replace(old, new)


def _with_depth_check(old: str) -> str:
    """0009's function with the depth parameter, its range check and the depth check."""
    bytes_param = "    p_max_payload_bytes integer DEFAULT 65536\n"
    new = _once(old, bytes_param, bytes_param.rstrip("\n") + ",\n"
                "    p_max_payload_depth integer DEFAULT 64\n")  # fmt: skip
    new = _once(new, "    found_id text;\n", "    found_id text;\n    shape text;\n"
                "    depth integer;\n")  # fmt: skip
    payload_check = "    IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' THEN\n"
    new = _once(
        new,
        payload_check,
        "    IF p_max_payload_depth IS NULL OR p_max_payload_depth NOT BETWEEN 1 AND 256 THEN\n"
        "        RAISE EXCEPTION 'outbox_publish: max_payload_depth must be from 1 to 256'\n"
        "            USING ERRCODE = '22023';\n"
        "    END IF;\n" + payload_check,
    )
    keys_check = "    IF (p_idempotency_key IS NOT NULL"
    return _once(new, keys_check, DEPTH_CHECK.lstrip("\n") + keys_check)


def upgrade() -> None:
    op.execute(f"DROP FUNCTION {OLD_SIGNATURE}")
    op.execute(_with_depth_check(_contract().PUBLISH))


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {NEW_SIGNATURE}")
    op.execute(_contract().PUBLISH)
