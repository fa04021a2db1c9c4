"""The metadata, naming convention and shared column helpers every schema module declares with."""

from __future__ import annotations

from sqlalchemy import (
    Column,
    DateTime,
    MetaData,
    func,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING)

DELIVERY_STATES = ("scheduled", "in_flight", "succeeded", "dead", "discarded", "held")
# What an ambiguous outcome does (endpoints and event types, migration 0031; NULL: retry).
ON_AMBIGUOUS = ("retry", "hold")
# An owner is a team name: a short slug (migration 0031 checks the same).
OWNER_FORMAT = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
TERMINAL_STATES = ("succeeded", "dead", "discarded")
ATTEMPT_OUTCOMES = ("succeeded", "retryable", "permanent", "ambiguous")


def _now_column(name: str) -> Column[object]:
    return Column(name, DateTime(timezone=True), nullable=False, server_default=func.now())
