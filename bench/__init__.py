"""The webhook-outbox benchmark: `python -m bench` (see docs/readme-bench.md)."""
