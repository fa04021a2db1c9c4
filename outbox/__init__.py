"""webhook-outbox: reliable webhooks through a transactional outbox in PostgreSQL.

Application code needs only `publish` (or `publish_async`) on its own connection or
session; everything else runs in the `outbox run` service.
"""

from outbox.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    EndpointError,
    OutboxError,
    PublishError,
)
from outbox.publish import publish, publish_async

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailableError",
    "EndpointError",
    "OutboxError",
    "PublishError",
    "publish",
    "publish_async",
]
