"""One error hierarchy for the delivery package; every message says what to do next.

Errors that describe configuration or endpoint definitions also subclass the
matching `outbox.errors` class, so the CLI (the one composition root) can report
them with the handler it already has for the outbox package.
"""

from __future__ import annotations

from outbox.errors import ConfigurationError, InvalidEndpointURLError, OutboxError

__all__ = [
    "AddressRefusedError",
    "DeliveryConfigurationError",
    "DeliveryError",
    "InvalidEndpointURLError",
]


class DeliveryError(OutboxError):
    """Base class of every error this package raises on purpose."""


class DeliveryConfigurationError(DeliveryError, ConfigurationError):
    """A delivery setting (for example OUTBOX_ALLOWED_NETWORKS) is invalid; raised at start-up."""


class AddressRefusedError(DeliveryError):
    """The SSRF guard refused to connect to an address; a PERMANENT delivery failure.

    Raised from inside an httpx request (the guarded transport's connect step) and
    passed through unchanged (only httpcore's own errors become httpx's), so the
    worker catches this class itself:
    it is not an `httpx.HTTPError`. Retrying cannot help until an operator changes
    the endpoint URL or OUTBOX_ALLOWED_NETWORKS, so nothing is retried.
    """

    def __init__(self, address: str, reason: str, *, host: str | None = None) -> None:
        self.address = address
        self.reason = reason
        self.host = host
        target = address if host is None or host == address else f"{host!r} ({address})"
        super().__init__(
            f"refused to connect to {target}: {reason}; if this endpoint really is meant to "
            f"be internal, add its network to OUTBOX_ALLOWED_NETWORKS, otherwise fix the "
            f"endpoint URL"
        )


class WebhookVerificationError(DeliveryError, ValueError):
    """A received webhook failed verification; answer it with 400 and do not process it."""


class MissingHeaderError(WebhookVerificationError):
    """A required `webhook-*` header is absent or empty."""


class TimestampError(WebhookVerificationError):
    """`webhook-timestamp` is malformed or outside the tolerance (a replay, or clock skew)."""


class SignatureMismatchError(WebhookVerificationError):
    """No `v1` signature in `webhook-signature` matches the body under this secret."""


class InvalidPayloadError(WebhookVerificationError):
    """The signature is valid but the body is not a UTF-8 JSON object."""
