"""Delivery side of webhook-outbox: workers, signing, the SSRF guard, and `verify` for receivers."""

from delivery.verify import verify

__all__ = ["verify"]
