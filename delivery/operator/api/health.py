"""Probes that need no token: liveness and readiness (database reachable, schema usable)."""

from __future__ import annotations

import logging
from typing import Any

from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, text
from starlette.responses import JSONResponse

from delivery.operator.api.core import Call, Operation
from outbox.migrate import VERSION_TABLE, release_version, schema_state

log = logging.getLogger("delivery.operator.api")


async def healthz(call: Call) -> Any:
    return {"status": "ok"}


async def readyz(call: Call) -> Any:
    def check(conn: Connection) -> str | None:
        conn.execute(text("SELECT 1"))
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()

    release = {"version": release_version(), "needs": call.api.head}
    try:
        revision = await call.api.read(check)
    except Exception as exc:
        log.warning("readiness check failed: %s", exc)
        return JSONResponse(
            {"status": "unavailable", "error": "database unreachable", **release}, 503
        )
    state = schema_state(revision)
    if not state.usable:
        return JSONResponse(
            {
                "status": "unavailable",
                "error": f"schema at {revision}, needs {call.api.head}: run `outbox migrate`",
                "schema": revision,
                **release,
            },
            503,
        )
    # "newer": a later release migrated it, which this one runs on (docs/operating.md, Upgrading).
    return {"status": "ready", "schema": revision, "schema_state": state.state, **release}


routes = [
    Operation("GET", "/healthz", None, "The process is alive.", healthz),
    Operation(
        "GET",
        "/readyz",
        None,
        "The database is reachable and migrated: this release's version, the schema "
        "revision it needs and the database's.",
        readyz,
    ),
]
