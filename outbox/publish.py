"""`publish()`: write an event in the caller's own transaction.

Nothing here commits. If the caller rolls back, the event never existed; if it
commits, the relay will deliver it. Everything that can be wrong with the input is
checked before the first statement runs, so a refused event leaves the caller's
transaction untouched.
"""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import Connection, TextClause
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox import tracing
from outbox.catalogue import CACHE, OPERATIONAL_EVENT_TYPES, Entry, Mode, mode_from_environment
from outbox.errors import ConfigurationError, IdempotencyConflict, PublishError
from outbox.ids import new_message_id
from outbox.sql.catalogue import SELECT_EVENT_TYPE_FOR_PUBLISH
from outbox.sql.events import FIND_EVENT_BY_IDEMPOTENCY_KEY, INSERT_EVENT
from outbox.tenants import DEFAULT_TENANT, validate_tenant_uid

DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024
# Nesting deeper than this is refused at publish: readers (json, psycopg, the CLI and
# the API) recurse per level, so a 990-level payload would break them, not the writer.
DEFAULT_MAX_PAYLOAD_DEPTH = 64
MAX_PAYLOAD_DEPTH_LIMIT = 256
_EVENT_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*$")
_MAX_EVENT_TYPE = 200
_MAX_KEY = 255
# A subject names a document ("invoice/inv_7"), not a payload: short, printable.
MAX_SUBJECT = 255
_PRIORITY_RANGE = range(-100, 101)
BYTES_VARIABLE = "OUTBOX_MAX_PAYLOAD_BYTES"
DEPTH_VARIABLE = "OUTBOX_MAX_PAYLOAD_DEPTH"


def payload_limits(bytes_limit: int | None, depth_limit: int | None) -> tuple[int, int]:
    """The limits publish() applies: the caller's, else OUTBOX_MAX_PAYLOAD_BYTES and
    OUTBOX_MAX_PAYLOAD_DEPTH from the environment (as the settings read them), else the
    defaults. Parsed once per value: publishing reads two dictionary entries."""
    if bytes_limit is None:
        bytes_limit = _limit_from(BYTES_VARIABLE, os.environ.get(BYTES_VARIABLE, ""))
    if depth_limit is None:
        depth_limit = _limit_from(DEPTH_VARIABLE, os.environ.get(DEPTH_VARIABLE, ""))
    return bytes_limit, depth_limit


@functools.lru_cache(maxsize=16)
def _limit_from(variable: str, raw: str) -> int:
    default, highest = (
        (DEFAULT_MAX_PAYLOAD_BYTES, 2**31 - 1)
        if variable == BYTES_VARIABLE
        else (DEFAULT_MAX_PAYLOAD_DEPTH, MAX_PAYLOAD_DEPTH_LIMIT)
    )
    if not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= highest:
        raise ConfigurationError(
            f"{variable}={raw!r} must be a whole number from 1 to {highest} (default {default})"
        )
    return value


@dataclass(frozen=True, slots=True)
class PreparedEvent:
    message_id: str
    tenant: str
    event_type: str
    payload_json: str
    idempotency_key: str | None
    ordering_key: str | None
    priority: int | None  # None: the event type's default (event_type_priorities), else 0
    payload: Any = None
    subject: str | None = None

    def params(self, entry: Entry, traceparent: str | None = None) -> dict[str, Any]:
        return {
            "catalogue_revision": entry.revision,
            "traceparent": traceparent,
            "message_id": self.message_id,
            "tenant": self.tenant,
            "event_type": self.event_type,
            "payload": self.payload_json,
            "idempotency_key": self.idempotency_key,
            "ordering_key": self.ordering_key,
            "priority": self.priority,
            "subject": self.subject,
        }

    def lookup_params(self) -> dict[str, Any]:
        """What FIND_EVENT_BY_IDEMPOTENCY_KEY compares the first event with."""
        return {
            "tenant": self.tenant,
            "idempotency_key": self.idempotency_key,
            "event_type": self.event_type,
            "ordering_key": self.ordering_key,
            "payload": self.payload_json,
        }


# The catalogue changed between our read and our insert (another process updated it)
# at most this many times in a row before publish() gives up.
_CATALOGUE_RETRIES = 3
_STALE = ""


def _mode(strict: bool | None) -> Mode:
    if strict is None:
        return mode_from_environment()
    return "strict" if strict else "accept"


def _message_id(row: Sequence[Any], event: PreparedEvent) -> str:
    """The id INSERT_EVENT (or the lookup) answered; refuses a reused key with other input."""
    found, differs = row[0], row[1]
    # INSERT_EVENT answers one NULL row when the tenant does not exist (nothing written).
    if found is None:
        raise PublishError(
            f"unknown tenant {event.tenant!r}: create it first (`outbox tenants add "
            f"{event.tenant}`), or omit tenant= for the default tenant"
        )
    if differs is not None:
        raise IdempotencyConflict(str(event.idempotency_key), str(found), str(differs))
    return str(found)


def validate_subject(subject: object, *, error: type[Exception] = PublishError) -> str:
    """A subject as publish() stores it: 1 to MAX_SUBJECT characters, no control characters
    (a log line or a console cell must show exactly what was stored)."""
    if not isinstance(subject, str) or not subject or len(subject) > MAX_SUBJECT:
        raise error(
            f"subject must be a non-empty string of at most {MAX_SUBJECT} characters naming "
            "the document the event is about, e.g. 'invoice/inv_7'"
        )
    if unstorable_text(subject):
        raise error(
            "subject contains a control character or a lone surrogate: use printable text, "
            "e.g. 'invoice/inv_7'"
        )
    return subject


def unstorable_text(value: str) -> bool:
    """NUL, another C0/C1 control or a lone surrogate: PostgreSQL text cannot hold them all."""
    return any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value)


def _check_text(value: str, where: str) -> None:
    # NUL: jsonb refuses \u0000 (a DataError, after the caller's transaction is spoilt).
    # A lone surrogate cannot be encoded as UTF-8 at all. Other control characters are
    # valid JSON text and stay allowed in the payload. A backslash followed by "u0000"
    # is six ordinary characters and is allowed.
    if "\x00" in value:
        raise PublishError(
            f"payload {where} contains a NUL character, which PostgreSQL cannot store: remove it"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PublishError(
            f"payload {where} contains a lone surrogate ({exc.reason}), which is not valid "
            "UTF-8: decode your input properly (errors='replace' if it must be lossy)"
        ) from exc


def _check_payload_shape(payload: dict[str, Any], max_depth: int) -> None:
    """Depth, NUL and surrogates, checked without recursion (a deep payload cannot crash it)."""
    if (
        isinstance(max_depth, bool)
        or not isinstance(max_depth, int)
        or not 1 <= max_depth <= MAX_PAYLOAD_DEPTH_LIMIT
    ):
        raise PublishError(
            f"max_payload_depth must be an integer from 1 to {MAX_PAYLOAD_DEPTH_LIMIT}"
        )
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list | tuple):
            if depth > max_depth:
                raise PublishError(
                    f"payload nests deeper than {max_depth} levels (or refers to itself): "
                    "flatten it, or raise OUTBOX_MAX_PAYLOAD_DEPTH"
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(key, str):
                        _check_text(key, "key")
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value, "text")


def prepare_event(
    event_type: str,
    payload: Any,
    *,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    priority: int | None = None,
    tenant: str = DEFAULT_TENANT,
    max_payload_bytes: int | None = None,
    max_payload_depth: int | None = None,
    subject: str | None = None,
) -> PreparedEvent:
    """Validate and serialise an event; raises PublishError and writes nothing. Without
    limits, OUTBOX_MAX_PAYLOAD_BYTES and OUTBOX_MAX_PAYLOAD_DEPTH apply (see payload_limits)."""
    max_payload_bytes, max_payload_depth = payload_limits(max_payload_bytes, max_payload_depth)
    tenant = validate_tenant_uid(tenant, error=PublishError)
    if not isinstance(event_type, str) or not _EVENT_TYPE.match(event_type):
        raise PublishError(
            f"event type {event_type!r} is invalid: use dot-separated words of letters, digits, "
            "'_' or '-', e.g. 'order.created'"
        )
    if len(event_type) > _MAX_EVENT_TYPE:
        raise PublishError(f"event type is longer than {_MAX_EVENT_TYPE} characters")
    if event_type in OPERATIONAL_EVENT_TYPES:
        raise PublishError(
            f"{event_type!r} is an operational event the service publishes itself; "
            "choose another event type"
        )
    if not isinstance(payload, dict):
        raise PublishError(f"payload must be a JSON object (a dict), not {type(payload).__name__}")
    _check_payload_shape(payload, max_payload_depth)
    try:
        payload_json = json.dumps(
            payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        )
    except (TypeError, ValueError) as exc:
        raise PublishError(
            f"payload is not JSON-serialisable ({exc}); convert it to plain dicts, lists, "
            "strings, numbers, booleans and None first"
        ) from exc
    size = len(payload_json.encode())
    if size > max_payload_bytes:
        raise PublishError(
            f"payload is {size} bytes, over the {max_payload_bytes}-byte limit: send ids and "
            "let the receiver fetch the rest (or raise OUTBOX_MAX_PAYLOAD_BYTES)"
        )
    for name, key in (("idempotency_key", idempotency_key), ("ordering_key", ordering_key)):
        if key is not None and (not isinstance(key, str) or not key or len(key) > _MAX_KEY):
            raise PublishError(f"{name} must be a non-empty string of at most {_MAX_KEY} chars")
        if key is not None and unstorable_text(key):
            raise PublishError(
                f"{name} contains a NUL, a control character or a lone surrogate, which "
                "PostgreSQL cannot store: use printable text"
            )
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or priority not in _PRIORITY_RANGE
    ):
        raise PublishError("priority must be an integer from -100 to 100 (higher goes first)")
    if subject is not None:
        subject = validate_subject(subject)
    return PreparedEvent(
        message_id=new_message_id(),
        tenant=tenant,
        event_type=event_type,
        payload_json=payload_json,
        idempotency_key=idempotency_key,
        ordering_key=ordering_key,
        priority=priority,
        payload=payload,
        subject=subject,
    )


Rows = Sequence[Sequence[Any]]

# The statements publish() runs, as psycopg's own SQL: an application that holds a bare
# psycopg connection publishes without SQLAlchemy's per-statement work.
_PSYCOPG_SQL: dict[TextClause, str] = {
    statement: str(statement.compile(dialect=PGDialect_psycopg()))  # type: ignore[no-untyped-call]
    for statement in (INSERT_EVENT, FIND_EVENT_BY_IDEMPOTENCY_KEY, SELECT_EVENT_TYPE_FOR_PUBLISH)
}

SyncConnection = Connection | Session | psycopg.Connection[Any]
AsyncAnyConnection = AsyncConnection | AsyncSession | psycopg.AsyncConnection[Any]


def _sync_statements(
    conn: SyncConnection,
) -> tuple[Callable[[TextClause, dict[str, Any]], Rows], Callable[[str], Entry]]:
    """(run a statement, load an event type) on the caller's connection."""
    if isinstance(conn, psycopg.Connection):
        pg = conn

        def run_psycopg(statement: TextClause, params: dict[str, Any]) -> Rows:
            # tuple rows whatever row factory the application set on its connection
            with pg.cursor(row_factory=tuple_row) as cursor:
                cursor.execute(_PSYCOPG_SQL[statement], params)
                return cursor.fetchall()

        def load_psycopg(name: str) -> Entry:
            rows = run_psycopg(SELECT_EVENT_TYPE_FOR_PUBLISH, {"name": name})
            return CACHE.store(name, rows[0] if rows else None)

        return run_psycopg, load_psycopg
    connection = conn.connection() if isinstance(conn, Session) else conn

    def run(statement: TextClause, params: dict[str, Any]) -> Rows:
        return connection.execute(statement, params).all()

    def load(name: str) -> Entry:
        return CACHE.load(connection, name)

    return run, load


async def _async_statements(
    conn: AsyncAnyConnection,
) -> tuple[
    Callable[[TextClause, dict[str, Any]], Awaitable[Rows]], Callable[[str], Awaitable[Entry]]
]:
    """The asyncio twin of `_sync_statements`."""
    if isinstance(conn, psycopg.AsyncConnection):
        pg = conn

        async def run_psycopg(statement: TextClause, params: dict[str, Any]) -> Rows:
            async with pg.cursor(row_factory=tuple_row) as cursor:
                await cursor.execute(_PSYCOPG_SQL[statement], params)
                return await cursor.fetchall()

        async def load_psycopg(name: str) -> Entry:
            rows = await run_psycopg(SELECT_EVENT_TYPE_FOR_PUBLISH, {"name": name})
            return CACHE.store(name, rows[0] if rows else None)

        return run_psycopg, load_psycopg
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn

    async def run(statement: TextClause, params: dict[str, Any]) -> Rows:
        return (await connection.execute(statement, params)).all()

    async def load(name: str) -> Entry:
        return await connection.run_sync(CACHE.load, name)

    return run, load


def _found(rows: Rows, event: PreparedEvent) -> Rows:
    if not rows:
        # Only a snapshot older than the other transaction's commit (REPEATABLE READ or
        # SERIALIZABLE) can miss the row its insert conflicted with.
        raise PublishError(
            f"idempotency key {event.idempotency_key!r} was published by a transaction this "
            "one's snapshot cannot see: retry the transaction"
        )
    return rows


def publish(
    conn: SyncConnection,
    event_type: str,
    payload: Any,
    *,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    priority: int | None = None,
    tenant: str = DEFAULT_TENANT,
    max_payload_bytes: int | None = None,
    strict: bool | None = None,
    max_payload_depth: int | None = None,
    subject: str | None = None,
) -> str:
    """Add an event to the outbox inside the caller's transaction; returns its message id.

    `conn` is a SQLAlchemy Connection or Session, or a psycopg Connection; nothing is
    committed on it. The event goes to `tenant`'s matching endpoints only (and to
    endpoints that take every tenant's events); without one, to the default tenant's. An
    unknown tenant is refused (`outbox tenants add` creates it). Publishing the same
    idempotency key twice for one tenant with the same input (event type, payload compared
    canonically, ordering key) returns the first event's id; other input under the key
    raises IdempotencyConflict and writes nothing. Without a `priority`, the event type's
    default applies (`outbox priorities set`), else 0. `subject` names the document the
    event is about ("invoice/inv_7"): `outbox.status_by_subject` finds its events.

    A type in the event-type catalogue must carry a payload its current JSON Schema
    accepts, and must not be archived. An unknown type is accepted unless `strict`
    (default: `OUTBOX_EVENT_TYPES=strict` in the environment) refuses it.
    """
    event = prepare_event(
        event_type,
        payload,
        idempotency_key=idempotency_key,
        ordering_key=ordering_key,
        priority=priority,
        tenant=tenant,
        max_payload_bytes=max_payload_bytes,
        max_payload_depth=max_payload_depth,
        subject=subject,
    )
    mode = _mode(strict)
    run, load = _sync_statements(conn)
    name = event.event_type
    cached = CACHE.get(name)
    entry = cached if cached is not None else load(name)
    with tracing.publish_span(event.event_type, event.tenant) as (span, traceparent):
        for _ in range(_CATALOGUE_RETRIES):
            if not entry.allows(event.payload, mode=mode):
                # A refusal is never made on a cached entry alone: read the type again
                # first (refusals are rare, so this costs nothing on the happy path).
                if entry is cached:
                    entry = load(name)
                entry.check(event.payload, mode=mode)
            rows = run(INSERT_EVENT, event.params(entry, traceparent))
            if not any(row[0] == _STALE for row in rows):
                break
            entry = load(name)
        else:
            raise PublishError("the event-type catalogue kept changing during publish; retry")
        if not rows:
            rows = _found(run(FIND_EVENT_BY_IDEMPOTENCY_KEY, event.lookup_params()), event)
        message_id = _message_id(rows[0], event)
        tracing.set_message_id(span, message_id)
    return message_id


async def publish_async(
    conn: AsyncAnyConnection,
    event_type: str,
    payload: Any,
    *,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    priority: int | None = None,
    tenant: str = DEFAULT_TENANT,
    max_payload_bytes: int | None = None,
    strict: bool | None = None,
    max_payload_depth: int | None = None,
    subject: str | None = None,
) -> str:
    """The asyncio twin of `publish` (an AsyncConnection, AsyncSession or psycopg
    AsyncConnection); same rules, never commits."""
    event = prepare_event(
        event_type,
        payload,
        idempotency_key=idempotency_key,
        ordering_key=ordering_key,
        priority=priority,
        tenant=tenant,
        max_payload_bytes=max_payload_bytes,
        max_payload_depth=max_payload_depth,
        subject=subject,
    )
    mode = _mode(strict)
    run, load = await _async_statements(conn)
    name = event.event_type
    cached = CACHE.get(name)
    entry = cached if cached is not None else await load(name)
    with tracing.publish_span(event.event_type, event.tenant) as (span, traceparent):
        for _ in range(_CATALOGUE_RETRIES):
            if not entry.allows(event.payload, mode=mode):
                if entry is cached:
                    entry = await load(name)
                entry.check(event.payload, mode=mode)
            rows = await run(INSERT_EVENT, event.params(entry, traceparent))
            if not any(row[0] == _STALE for row in rows):
                break
            entry = await load(name)
        else:
            raise PublishError("the event-type catalogue kept changing during publish; retry")
        if not rows:
            rows = _found(await run(FIND_EVENT_BY_IDEMPOTENCY_KEY, event.lookup_params()), event)
        message_id = _message_id(rows[0], event)
        tracing.set_message_id(span, message_id)
    return message_id
