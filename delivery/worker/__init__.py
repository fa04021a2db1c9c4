"""Delivery workers (moving into modules)."""

from delivery.worker.loop import (
    BARREN_FOR,
    BatchStats,
    ClaimedDelivery,
    Worker,
    WorkerConfig,
    default_worker_id,
    render_body,
)

__all__ = [
    "BARREN_FOR",
    "BatchStats",
    "ClaimedDelivery",
    "Worker",
    "WorkerConfig",
    "default_worker_id",
    "render_body",
]
