"""webhook-outbox: reliable webhooks through a transactional outbox in PostgreSQL.

Application code needs only `publish` (or `publish_async`) on its own connection or
session, `status` / `status_by_subject` to tell its own user what became of an event, and
`database_url()` to find the database when it uses the embedded one; everything else runs
in the `outbox run` service.

`publish`, `publish_async` and the `status` family load on first use (SQLAlchemy, psycopg
and the schema validator take most of a second to import), so `import outbox.errors`, the
`outbox` command's help and the service's light modules do not pay for them.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from outbox.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    EndpointError,
    IdempotencyConflict,
    OutboxError,
    PublishError,
)

if TYPE_CHECKING:
    from outbox.publish import publish, publish_async
    from outbox.status import (
        EndpointStatus,
        EventStatus,
        status,
        status_async,
        status_by_subject,
        status_by_subject_async,
    )

# name -> the module that defines it, imported on first use
_LAZY: dict[str, str] = {
    "publish": "outbox.publish",
    "publish_async": "outbox.publish",
    "status": "outbox.status",
    "status_async": "outbox.status",
    "status_by_subject": "outbox.status",
    "status_by_subject_async": "outbox.status",
    "EventStatus": "outbox.status",
    "EndpointStatus": "outbox.status",
}


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise take any outbox.name as Any

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            import importlib

            module = importlib.import_module(_LAZY[name])
            globals().update({n: getattr(module, n) for n, m in _LAZY.items() if m == _LAZY[name]})
            return globals()[name]
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps `outbox.publish` and `outbox.status` the functions: importing the submodules
    of the same names would otherwise bind the modules over them."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def database_url() -> str:
    """The outbox database's SQLAlchemy URL: OUTBOX_DATABASE_URL, or the embedded server.

    The embedded server (the one the `outbox` command uses) is started and migrated if
    needed; see `outbox.connect`.
    """
    from outbox.connect import database_url as _database_url  # alembic loads on first use

    return _database_url()


__all__ = [
    "ConfigurationError",
    "DatabaseUnavailableError",
    "EndpointError",
    "EndpointStatus",
    "EventStatus",
    "IdempotencyConflict",
    "OutboxError",
    "PublishError",
    "database_url",
    "publish",
    "publish_async",
    "status",
    "status_async",
    "status_by_subject",
    "status_by_subject_async",
]
