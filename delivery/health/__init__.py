"""Endpoint health (moving into modules)."""

from delivery.health.rules import *  # noqa: F403
