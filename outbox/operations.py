"""The operator's actions in one namespace (`from outbox import operations as ops`).

Nothing is defined here: each job has its own module, and new code imports that module.
Deliveries (search, inspect, replay, discard) are outbox.deliveries; audited endpoint
changes are outbox.endpoints; the audit log is outbox.audit. The operator side (CLI,
admin API, console) reaches them through this one name.
"""

from __future__ import annotations

from outbox.audit import MAX_AUDIT_PAGE, AuditEntry, list_audit
from outbox.deliveries import (
    DEFAULT_BULK_LIMIT,
    DISCARDABLE_STATES,
    MAX_PAGE,
    PENDING_STATES,
    REPLAYABLE_STATES,
    SAMPLE_SIZE,
    DeliveryDetail,
    DeliveryFilter,
    DeliverySummary,
    ReplayResult,
    bulk_replay,
    count_deliveries,
    discard,
    get_delivery,
    replay,
    search_deliveries,
)
from outbox.endpoints import (
    RotatedSecret,
    add_endpoint,
    delete_endpoint,
    get_endpoint,
    rotate_secret,
    update_endpoint,
)
from outbox.schema import LATENCY_BUCKETS

__all__ = [
    "DEFAULT_BULK_LIMIT",
    "DISCARDABLE_STATES",
    "LATENCY_BUCKETS",
    "MAX_AUDIT_PAGE",
    "MAX_PAGE",
    "PENDING_STATES",
    "REPLAYABLE_STATES",
    "SAMPLE_SIZE",
    "AuditEntry",
    "DeliveryDetail",
    "DeliveryFilter",
    "DeliverySummary",
    "ReplayResult",
    "RotatedSecret",
    "add_endpoint",
    "bulk_replay",
    "count_deliveries",
    "delete_endpoint",
    "discard",
    "get_delivery",
    "get_endpoint",
    "list_audit",
    "replay",
    "rotate_secret",
    "search_deliveries",
    "update_endpoint",
]
