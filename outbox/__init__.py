"""webhook-outbox: reliable webhooks through a transactional outbox in PostgreSQL.

Application code needs only `publish` (or `publish_async`) on its own connection or
session, and `database_url()` to find the database when it uses the embedded one;
everything else runs in the `outbox run` service.
"""

from outbox.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    EndpointError,
    OutboxError,
    PublishError,
)
from outbox.publish import publish, publish_async


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
    "OutboxError",
    "PublishError",
    "database_url",
    "publish",
    "publish_async",
]
