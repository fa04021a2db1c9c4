"""The event-type catalogue: which events exist, and the JSON Schema of each one's payload.

A type has versions: `update` with a new schema adds one and makes it current; older
versions stay readable (partners pinned to them can still look them up). A type can be
deprecated (still published, marked so in the docs) and archived (publishing refused).

`publish()` validates a payload against the current schema before writing anything. The
compiled validators are cached per process, keyed by the type's `revision` (a random
token that changes with every catalogue change). The cache is never trusted blindly:
publish's own INSERT compares the cached revision with the row's, so a change made by
another process is noticed in the same round trip, and the publish is retried against
the new schema. Nothing is queried per publish beyond that one statement.

Unknown types are accepted by default, so adopting the catalogue breaks nobody;
`OUTBOX_EVENT_TYPES=strict` refuses them (see docs/contract.md).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.errors import (
    CatalogueError,
    CatalogueNotFoundError,
    ConfigurationError,
    PublishError,
)
from outbox.schema_rules import (
    DEFAULT_VALIDATION_BUDGET,
    CatalogueRef,
    CompiledSchema,
    SchemaLimits,
    bundle,
    compile_schema,
    vet_schema,
)
from outbox.sql import catalogue as queries
from outbox.webhook_contract import render_openapi

Mode = Literal["accept", "strict"]
MODES: tuple[Mode, ...] = ("accept", "strict")
MODE_VARIABLE = "OUTBOX_EVENT_TYPES"
BUDGET_VARIABLE = "OUTBOX_VALIDATION_BUDGET_MS"
MAX_VALIDATION_BUDGET_MS = 10_000.0
DEFAULT_LIMITS = SchemaLimits()

# The service publishes these itself (delivery/operational.py); applications may not
# (publish(), outbox_publish() and the catalogue refuse them).
OPERATIONAL_EVENT_TYPES = (
    "endpoint.disabled",
    "endpoint.breaker_opened",
    "endpoint.recovered",
    "delivery.dead",
    "delivery.held",
    "tenant.disabled",
)
# The same, as a SQL list for the queries that route or report them (outbox/sql/relay.py,
# delivery/queries.py); the database's own copy is outbox_operational_event_types()
# (migration 0040), compared with this one by tests/outbox/test_operational_types.py.
OPERATIONAL_EVENT_TYPES_SQL = "(" + ", ".join(f"'{name}'" for name in OPERATIONAL_EVENT_TYPES) + ")"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*$")
_MAX_NAME = 200
ABSENT = ""  # the revision publish() passes for a type that is not in the catalogue


def mode_from_environment(value: str | None = None) -> Mode:
    """`OUTBOX_EVENT_TYPES` (accept | strict), read when publishing: a dictionary lookup."""
    raw = os.environ.get(MODE_VARIABLE, "") if value is None else value
    mode = raw.strip().lower() or "accept"
    if mode not in MODES:
        raise ConfigurationError(
            f"{MODE_VARIABLE}={raw!r} is not a mode: use 'accept' (the default: unknown event "
            "types are published unchecked) or 'strict' (unknown types are refused)"
        )
    return "strict" if mode == "strict" else "accept"


@dataclass(frozen=True, slots=True)
class EventTypeVersion:
    version: int
    schema: dict[str, Any]
    example: dict[str, Any] | None
    created_at: dt.datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "schema": self.schema,
            "example": self.example,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class EventType:
    name: str
    description: str
    status: str
    current_version: int
    schema: dict[str, Any]
    example: dict[str, Any] | None
    created_at: dt.datetime
    updated_at: dt.datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "status": self.status,
            "version": self.current_version,
            "schema": self.schema,
            "example": self.example,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


# -- validation ---------------------------------------------------------------------------


def budget_from_environment() -> float:
    """OUTBOX_VALIDATION_BUDGET_MS in seconds, read when publishing (parsed once per value)."""
    return _budget(os.environ.get(BUDGET_VARIABLE, ""))


@functools.lru_cache(maxsize=8)
def _budget(raw: str) -> float:
    if not raw.strip():
        return DEFAULT_VALIDATION_BUDGET
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1 <= value <= MAX_VALIDATION_BUDGET_MS:
        raise ConfigurationError(
            f"{BUDGET_VARIABLE}={raw!r} must be a number of milliseconds from 1 to "
            f"{MAX_VALIDATION_BUDGET_MS:g} (default {DEFAULT_VALIDATION_BUDGET * 1000:g})"
        )
    return value / 1000


@dataclass(frozen=True, slots=True)
class CheckedSchema:
    """A schema that keeps the catalogue's rules (catalogue references bundled in), and an
    example it accepts. Built off the admin server's event loop (see `check_new_schema`)."""

    schema: dict[str, Any]
    example: dict[str, Any] | None


VersionLoader = Callable[[set[CatalogueRef]], Mapping[CatalogueRef, dict[str, Any]]]


def referenced_versions(
    conn: Connection, refs: set[CatalogueRef]
) -> dict[CatalogueRef, dict[str, Any]]:
    """The schemas of the catalogue versions a new schema refers to; CatalogueError names a
    missing one."""
    found: dict[CatalogueRef, dict[str, Any]] = {}
    for ref in sorted(refs):
        schema = conn.execute(
            queries.SELECT_EVENT_TYPE_VERSION_SCHEMA, {"name": ref.name, "version": ref.version}
        ).scalar_one_or_none()
        if schema is None:
            raise CatalogueError(
                f"$ref {ref.urn!r} names no catalogued schema (no version {ref.version} of "
                f"event type {ref.name!r}); `outbox event-types show {ref.name}` lists them"
            )
        found[ref] = schema
    return found


def _check_here(
    conn: Connection, schema: Any, example: Any, limits: SchemaLimits, budget: float
) -> CheckedSchema:
    """`check_new_schema` in the caller's transaction, when nobody vetted it before."""
    return check_new_schema(
        schema,
        example,
        limits=limits,
        versions=lambda refs: referenced_versions(conn, refs),
        budget=budget,
    )


def check_new_schema(
    schema: Any,
    example: Any,
    *,
    limits: SchemaLimits,
    versions: VersionLoader,
    budget: float = DEFAULT_VALIDATION_BUDGET,
) -> CheckedSchema:
    """Every rule of schema_rules, then the example against the schema. `versions` loads
    the catalogue versions it refers to (they are vetted too, and bundled in)."""
    refs = vet_schema(schema, limits)
    if refs:
        loaded = versions(refs)
        for ref, contents in loaded.items():
            try:
                vet_schema(contents, limits)
            except CatalogueError as exc:
                raise CatalogueError(f"the schema of {ref.urn!r} cannot be reused: {exc}") from exc
        schema = bundle(schema, loaded)
        vet_schema(schema, limits)  # the caps hold for what is stored
    return CheckedSchema(schema, check_example(example, schema, budget))


# -- the per-process cache ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """What publish() needs to know about one type; `revision` is ABSENT when unknown."""

    name: str
    revision: str
    status: str | None = None
    version: int | None = None
    compiled: CompiledSchema | None = None

    def allows(self, payload: Any, *, mode: Mode, budget: float | None = None) -> bool:
        """The quick yes/no of `check` (no message built)."""
        if self.revision == ABSENT:
            return mode != "strict"
        if self.status == "archived":
            return False
        assert self.compiled is not None
        return self.compiled.is_valid(payload, budget=_or_default(budget))

    def check(
        self,
        payload: Any,
        *,
        mode: Mode,
        budget: float | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """Raise PublishError when this type may not carry `payload`; write nothing."""
        if self.revision == ABSENT:
            if mode == "strict":
                raise PublishError(
                    f"event type {self.name!r} is not in the catalogue and "
                    f"{MODE_VARIABLE}=strict refuses unknown types: add it with "
                    f"`outbox event-types add {self.name} --schema FILE`"
                )
            return
        if self.status == "archived":
            raise PublishError(
                f"event type {self.name!r} is archived: publish its successor, or "
                f"`outbox event-types update {self.name} --status active` to revive it"
            )
        assert self.compiled is not None
        problem = self.compiled.problem(payload, budget=_or_default(budget), timer=timer)
        if problem is not None:
            raise PublishError(
                f"payload does not match the schema of {self.name!r} (version {self.version}) "
                f"{problem}; fix the payload or publish a new schema version"
            )


def _or_default(budget: float | None) -> float:
    return budget_from_environment() if budget is None else budget


class SchemaCache:
    """Compiled schemas by type name; validated against the database on every insert."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def load(self, conn: Connection, name: str) -> Entry:
        row = conn.execute(queries.SELECT_EVENT_TYPE_FOR_PUBLISH, {"name": name}).first()
        return self.store(name, row)

    def store(self, name: str, row: Sequence[Any] | None) -> Entry:
        """Cache the type from a SELECT_EVENT_TYPE_FOR_PUBLISH row (None: not in the catalogue)."""
        if row is None:
            entry = Entry(name, ABSENT)
        else:
            revision, status, version, schema = row
            old = self._entries.get(name)
            # A version's schema never changes: keep its compiled validator across revisions.
            compiled = (
                old.compiled
                if old is not None
                and old.version == version
                and old.compiled is not None
                and old.compiled.schema == schema
                else compile_schema(schema)
            )
            entry = Entry(name, revision, status, version, compiled)
        with self._lock:
            self._entries[name] = entry
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CACHE = SchemaCache()


# -- catalogue operations (CLI and admin API) -----------------------------------------------


def valid_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or len(value) > _MAX_NAME:
        raise CatalogueError(
            f"event type {value!r} is invalid: use dot-separated words of letters, digits, '_' "
            "or '-' (at most 200 characters), e.g. 'order.created'"
        )
    if value in OPERATIONAL_EVENT_TYPES:
        raise CatalogueError(
            f"{value!r} is an operational event the service publishes itself; choose another name"
        )
    return value


def check_example(
    example: Any, schema: dict[str, Any], budget: float = DEFAULT_VALIDATION_BUDGET
) -> dict[str, Any] | None:
    """The example if the schema accepts it (within the validation budget), else CatalogueError."""
    if example is None:
        return None
    if not isinstance(example, dict):
        raise CatalogueError("an example must be a JSON object, like the payloads themselves")
    problem = compile_schema(schema).problem(example, budget=budget)
    if problem is not None:
        raise CatalogueError(f"the example does not match the schema {problem}")
    return example


def add_event_type(
    conn: Connection,
    name: str,
    *,
    schema: Any,
    description: str = "",
    example: Any = None,
    actor: str,
    request_id: str | None = None,
    limits: SchemaLimits = DEFAULT_LIMITS,
    budget: float = DEFAULT_VALIDATION_BUDGET,
    checked: CheckedSchema | None = None,
) -> EventType:
    """Add a type with its first schema version, in the caller's transaction. `checked`:
    the schema and example already vetted by `check_new_schema` (the admin server does
    that off its event loop); otherwise they are vetted here."""
    name = valid_name(name)
    if checked is None:
        checked = _check_here(conn, schema, example, limits, budget)
    schema, example = checked.schema, checked.example
    created = conn.execute(
        queries.INSERT_EVENT_TYPE, {"name": name, "description": description}
    ).scalar_one_or_none()
    if created is None:
        raise CatalogueError(
            f"event type {name!r} exists already: `outbox event-types update {name} --schema "
            "FILE` adds a new version"
        )
    conn.execute(
        queries.INSERT_EVENT_TYPE_VERSION,
        {"id": created, "version": 1, "schema": json.dumps(schema), "example": _dump(example)},
    )
    record_audit(
        conn,
        actor=actor,
        action="event_type.add",
        target_type="event_type",
        target_id=name,
        details={"version": 1},
        request_id=request_id,
    )
    return get_event_type(conn, name)


def update_event_type(
    conn: Connection,
    name: str,
    *,
    schema: Any = None,
    description: str | None = None,
    example: Any = None,
    status: str | None = None,
    actor: str,
    request_id: str | None = None,
    limits: SchemaLimits = DEFAULT_LIMITS,
    budget: float = DEFAULT_VALIDATION_BUDGET,
    checked: CheckedSchema | None = None,
    example_checked_for: int | None = None,
) -> EventType:
    """A new schema version (older ones stay readable), a new description, example or status.

    `checked`: a new schema (and example) vetted already by `check_new_schema`;
    `example_checked_for`: the version the example was checked against already (the admin
    server validates off its event loop). Otherwise both are checked here."""
    if checked is not None:
        schema, example = checked.schema, checked.example
    if schema is None and description is None and example is None and status is None:
        raise CatalogueError(
            "nothing to update: give --schema, --description, --example or --status"
        )
    # Locked first: two concurrent updates must not both claim the next version number.
    type_id = conn.execute(queries.LOCK_EVENT_TYPE, {"name": name}).scalar_one_or_none()
    if type_id is None:
        raise CatalogueNotFoundError(
            f"no event type {name!r}; `outbox event-types list` shows them"
        )
    current = get_event_type(conn, name)
    if status is not None and status not in ("active", "deprecated", "archived"):
        raise CatalogueError(f"status {status!r} is not one of active, deprecated, archived")
    version = current.current_version
    if schema is not None:
        if checked is None:
            checked = _check_here(conn, schema, example, limits, budget)
        schema = checked.schema
        # A new schema keeps the current example only if it still matches.
        example = (
            checked.example
            if example is not None
            else check_example(current.example, schema, budget)
        )
        version += 1
        conn.execute(
            queries.INSERT_EVENT_TYPE_VERSION,
            {
                "id": type_id,
                "version": version,
                "schema": json.dumps(schema),
                "example": _dump(example),
            },
        )
    elif example is not None:
        if example_checked_for != version:
            check_example(example, current.schema, budget)
        conn.execute(
            queries.SET_EVENT_TYPE_EXAMPLE,
            {"name": name, "version": version, "example": _dump(example)},
        )
    conn.execute(
        queries.UPDATE_EVENT_TYPE,
        {"name": name, "version": version, "description": description, "status": status},
    )
    record_audit(
        conn,
        actor=actor,
        action="event_type.update",
        target_type="event_type",
        target_id=name,
        details={
            "version": version,
            **({"status": status} if status else {}),
            **({"description": description} if description is not None else {}),
        },
        request_id=request_id,
    )
    return get_event_type(conn, name)


def set_status(
    conn: Connection, name: str, status: str, *, actor: str, request_id: str | None = None
) -> EventType:
    """Deprecate (still published, marked in the docs) or archive (publishing refused)."""
    return update_event_type(conn, name, status=status, actor=actor, request_id=request_id)


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def get_event_type(conn: Connection, name: str) -> EventType:
    row = conn.execute(queries.SELECT_EVENT_TYPE, {"name": name}).mappings().first()
    if row is None:
        raise CatalogueNotFoundError(
            f"no event type {name!r}; `outbox event-types list` shows them"
        )
    return EventType(**row)


def list_event_types(conn: Connection, *, include_archived: bool = True) -> list[EventType]:
    rows = conn.execute(queries.SELECT_EVENT_TYPES).mappings()
    types = [EventType(**row) for row in rows]
    return [t for t in types if include_archived or t.status != "archived"]


def list_versions(conn: Connection, name: str) -> list[EventTypeVersion]:
    get_event_type(conn, name)
    rows = conn.execute(queries.SELECT_EVENT_TYPE_VERSIONS, {"name": name}).mappings()
    return [EventTypeVersion(**row) for row in rows]


# -- the relay's check of events published through SQL -----------------------------------


UNREADABLE_PAYLOAD = (
    "payload nests too deeply to be read back (Python's JSON decoder gives up): "
    "publish it flatter (outbox_publish() refuses more than max_payload_depth levels)"
)


def read_stored_payload(payload_json: str) -> Any:
    """Decode a payload as stored. jsonb keeps nesting Python cannot decode (rows written
    before outbox_publish() checked depth, or by hand): that one event is refused with a
    reason instead of failing every batch it is in."""
    try:
        return json.loads(payload_json)
    except RecursionError:
        raise PublishError(UNREADABLE_PAYLOAD) from None


# One relay pass validates for at most this many payload budgets; the events it did not
# reach stay pending for the next pass, so the deliveries of everything else go on.
PASS_BUDGETS = 10


def validate_pending(
    conn: Connection,
    *,
    now: dt.datetime,
    mode: Mode,
    limit: int,
    budget: float = DEFAULT_VALIDATION_BUDGET,
    timer: Callable[[], float] = time.perf_counter,
) -> int:
    """Check events written by outbox_publish() against their schemas before the relay
    fans them out. Valid ones go on; the rest are rejected with the reason (visible in
    `outbox events rejected`, requeued with `outbox events requeue`). Returns the rejected.

    Each payload has `budget` seconds (over it: rejected with that reason), and the pass
    stops taking new ones after PASS_BUDGETS of them: one bad row, or many, cannot hold
    the relay's batch for long."""
    rows = conn.execute(queries.CLAIM_EVENTS_TO_VALIDATE, {"limit": limit}).all()
    if not rows:
        return 0
    entries: dict[str, Entry] = {}
    checked_ids: list[int] = []
    rejected_ids: list[int] = []
    reasons: list[str] = []
    stop_at = timer() + budget * PASS_BUDGETS
    for row in rows:
        if checked_ids and timer() > stop_at:
            break
        checked_ids.append(row.id)
        entry = entries.get(row.event_type)
        if entry is None:
            entry = entries[row.event_type] = CACHE.load(conn, row.event_type)
        try:
            payload = read_stored_payload(row.payload_json)
            entry.check(payload, mode=mode, budget=budget, timer=timer)
        except PublishError as exc:
            rejected_ids.append(row.id)
            reasons.append(str(exc))
    conn.execute(
        queries.FINISH_VALIDATION,
        {"ids": checked_ids, "rejected": rejected_ids, "reasons": reasons, "now": now},
    )
    return len(rejected_ids)


@dataclass(frozen=True, slots=True)
class RejectedEvent:
    message_id: str
    tenant: str
    event_type: str
    rejected_at: dt.datetime
    reason: str
    payload: dict[str, Any] | None  # None: too deeply nested to read (see the reason)

    def as_json(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "tenant": self.tenant,
            "event_type": self.event_type,
            "rejected_at": self.rejected_at.isoformat(),
            "reason": self.reason,
            "payload": self.payload,
        }


def list_rejected(
    conn: Connection, *, limit: int = 100, scope: str | None = None
) -> list[RejectedEvent]:
    """Rejected events, newest first; with `scope` (a tenant uid) that tenant's only."""
    rows = conn.execute(queries.SELECT_REJECTED_EVENTS, {"limit": limit, "scope": scope}).mappings()
    return [
        RejectedEvent(
            message_id=row["message_id"],
            tenant=row["tenant"],
            event_type=row["event_type"],
            rejected_at=row["rejected_at"],
            reason=row["reason"],
            payload=_readable_or_none(row["payload_json"]),
        )
        for row in rows
    ]


def _readable_or_none(payload_json: str) -> Any:
    """The payload, or None where it is too deep to read (the reason already says so)."""
    try:
        return read_stored_payload(payload_json)
    except PublishError:
        return None


def requeue_rejected(
    conn: Connection,
    message_id: str,
    *,
    skip_validation: bool = False,
    actor: str,
    reason: str,
    request_id: str | None = None,
    scope: str | None = None,
) -> None:
    """Put a rejected event back before the relay: checked again against the current schema
    (after fixing the schema, say), or sent unchecked with `skip_validation`. With `scope`,
    only that tenant's events (another tenant's is "not found")."""
    if not reason.strip():
        raise CatalogueError("requeueing a rejected event needs a reason (--reason)")
    done = conn.execute(
        queries.REQUEUE_REJECTED_EVENT,
        {"message_id": message_id, "validate": not skip_validation, "scope": scope},
    ).first()
    if done is None:
        raise CatalogueNotFoundError(
            f"no rejected event {message_id!r}; `outbox events rejected` lists them"
        )
    record_audit(
        conn,
        actor=actor,
        action="event.requeue",
        target_type="event",
        target_id=message_id,
        reason=reason,
        details={"skip_validation": skip_validation},
        request_id=request_id,
        tenant=done.tenant,
    )


def openapi_document(
    conn: Connection,
    *,
    title: str = "Webhooks",
    version: str = "1.0.0",
    include_operational: bool = True,
) -> dict[str, Any]:
    """An OpenAPI 3.1 document whose `webhooks` describe every catalogued, unarchived type
    and the service's own operational events (outbox.webhook_contract renders it)."""
    return render_openapi(
        list_event_types(conn, include_archived=False),
        title=title,
        version=version,
        include_operational=include_operational,
    )
