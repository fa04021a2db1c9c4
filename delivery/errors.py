"""One error hierarchy for the delivery package."""

from outbox.errors import OutboxError


class DeliveryError(OutboxError):
    """Base of the errors the delivery package raises on purpose."""
