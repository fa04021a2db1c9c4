"""The `outbox` command (being split by command group; see endpoints.py for now)."""

from delivery.operator.cli.endpoints import main, parse_duration

__all__ = ["main", "parse_duration"]
