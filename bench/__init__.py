"""The webhook-outbox benchmark: `python -m bench` (see docs/performance.md)."""
