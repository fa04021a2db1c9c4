"""Delivery workers: claim due deliveries, POST them outside any transaction, record outcomes.

Flow of one delivery through a worker:

    claim (one statement, commits)  ->  POST (no connection, no lock held)
        ->  outcome buffered  ->  written with others in one statement

Claims are leased: if this process dies, the reaper re-schedules the delivery
once the lease expires. Every claim carries a fencing token (the delivery's claim
number) that every write back must match, so a rescued delivery is never overwritten
by a late worker, not even by this one after it claimed the delivery again.
"""

from delivery.worker.loop import Worker
from delivery.worker.model import (
    BARREN_FOR,
    BatchStats,
    ClaimedDelivery,
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
