"""webhook-outbox: reliable webhooks through a transactional outbox in PostgreSQL.

Application code needs only `publish` (or `publish_async`) on its own connection or
session, `status` / `status_by_subject` to tell its own user what became of an event, and
`database_url()` to find the database when it uses the embedded one; everything else runs
in the `outbox run` service.
"""

from outbox.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    EndpointError,
    IdempotencyConflict,
    OutboxError,
    PublishError,
)
from outbox.publish import publish, publish_async
from outbox.status import (
    EndpointStatus,
    EventStatus,
    status,
    status_async,
    status_by_subject,
    status_by_subject_async,
)


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
