"""One error hierarchy for the outbox package; every message says what to do next."""


class OutboxError(Exception):
    """Base class of every error this package raises on purpose."""


class PublishError(OutboxError, ValueError):
    """An event was refused before anything was written; the message says which rule it broke."""


class EndpointError(OutboxError, ValueError):
    """An endpoint definition (URL, patterns, secret) is invalid, or the endpoint does not exist."""


class ConfigurationError(OutboxError):
    """A setting is missing or invalid; raised at start-up, never in the middle of work."""


class DatabaseUnavailableError(OutboxError):
    """The database could not be reached or started."""


class SecretKeyError(OutboxError):
    """Encrypted secrets cannot be read or written with the configured keys."""


class InvalidEndpointURLError(EndpointError):
    """An endpoint URL breaks a rule (scheme, host, credentials, length); says which and how."""


class OperationError(OutboxError, ValueError):
    """An operator action was refused (unknown row, wrong state, missing reason)."""


class NotFoundError(OperationError):
    """The delivery (or other row) an operator named does not exist."""


class TenantError(OutboxError, ValueError):
    """A tenant id is malformed, or names no tenant (`outbox tenants add` creates one)."""


class EndpointNotFoundError(EndpointError, NotFoundError):
    """No endpoint by that id (or none the caller's tenant scope can see: the same answer)."""


class TenantNotFoundError(TenantError, NotFoundError):
    """No tenant by that id (or none the caller's tenant scope can see: the same answer)."""


class CatalogueError(OutboxError, ValueError):
    """An event type or its schema is invalid, or names no catalogued type."""


class CatalogueNotFoundError(CatalogueError, NotFoundError):
    """No event type (or rejected event) by that name, or none the caller's scope can see."""


class FeedError(OutboxError, ValueError):
    """A catch-up feed request is malformed (cursor, limit); the message says what to send."""


class FeedAuthError(FeedError):
    """No valid feed token for a feed: missing, malformed, rotated or revoked (HTTP 401)."""


class FeedGoneError(FeedError):
    """The cursor is older than what retention kept (HTTP 410); restart at `oldest_cursor`."""

    def __init__(self, message: str, oldest_cursor: str) -> None:
        super().__init__(message)
        self.oldest_cursor = oldest_cursor
