"""The webhook-outbox benchmark: `python -m bench` (see the README's Performance section)."""
