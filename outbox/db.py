"""Engines and database URLs.

Every URL a user gives (`postgresql://...`) is normalised to the psycopg 3 driver,
for sync and async engines alike.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.errors import ConfigurationError, DatabaseUnavailableError


def sqlalchemy_url(url: str) -> str:
    """`postgresql://` / `postgres://` / `postgresql+psycopg://` -> `postgresql+psycopg://`."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigurationError(
            f"OUTBOX_DATABASE_URL is not a database URL ({exc}); "
            "expected postgresql://user:password@host:5432/dbname"
        ) from exc
    if parsed.get_backend_name() not in {"postgresql", "postgres"}:
        raise ConfigurationError(
            f"OUTBOX_DATABASE_URL must point at PostgreSQL, not {parsed.get_backend_name()!r}"
        )
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL without the SQLAlchemy driver part, for psycopg and psql."""
    return (
        make_url(sqlalchemy_url(url))
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


def redacted(url: str) -> str:
    """A URL safe to print: the password is masked."""
    return make_url(sqlalchemy_url(url)).render_as_string(hide_password=True)


def make_engine(url: str, **kwargs: Any) -> Engine:
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(sqlalchemy_url(url), **kwargs)


def make_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(sqlalchemy_url(url), **kwargs)


def check_reachable(engine: Engine) -> None:
    """Fail fast with a clear message instead of a stack trace from deep inside a service."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise DatabaseUnavailableError(
            f"cannot reach PostgreSQL at {redacted(str(engine.url))}: {reason}. "
            "Check OUTBOX_DATABASE_URL, or unset it to use the embedded server."
        ) from exc
