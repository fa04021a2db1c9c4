"""One error hierarchy for the outbox package; every message says what to do next."""


class OutboxError(Exception):
    """Base class of every error this package raises on purpose."""


class PublishError(OutboxError, ValueError):
    """An event was refused before anything was written; the message says which rule it broke."""


class IdempotencyConflict(PublishError):
    """An idempotency key was reused with another event type, payload or ordering key.

    A key stands for one business operation, so other input under it is a caller's bug,
    refused rather than merged. Nothing was written; `message_id` is the first event's.
    """

    def __init__(self, idempotency_key: str, message_id: str, differs: str) -> None:
        self.idempotency_key = idempotency_key
        self.message_id = message_id
        self.differs = differs
        super().__init__(
            f"idempotency key {idempotency_key!r} was already used by {message_id} with "
            f"another {differs}: a key stands for one operation, so publish other input "
            "under a new key (nothing was written)"
        )


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


class SupersededError(OperationError):
    """A replay was refused: a newer event of the same type and subject (or ordering key)
    was delivered to the same endpoint since, so the replay would send an older state after
    it. `superseded` maps each refused delivery id to that newer event's message id."""

    def __init__(self, message: str, superseded: dict[int, str]) -> None:
        super().__init__(message)
        self.superseded = superseded


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
