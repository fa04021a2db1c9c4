"""Moved to outbox/direct.py (the relay uses it too, and outbox/ never imports delivery/)."""

from outbox.direct import (
    DirectConnection,
    HeldConnection,
    Rows,
    Statements,
    compiled_sql,
    transaction,
)

__all__ = [
    "DirectConnection",
    "HeldConnection",
    "Rows",
    "Statements",
    "compiled_sql",
    "transaction",
]
