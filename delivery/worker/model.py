"""What the worker's parts share: its configuration, a claimed delivery, a batch's counts."""

from __future__ import annotations

import datetime as dt
import json
import socket
import types
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from delivery import health
from delivery.http import OutgoingRequest
from delivery.policy import DEFAULT_JITTER, RETRY_AFTER_MAX_SECONDS, Decision, Outcome, RetryPolicy
from outbox.settings import DEFAULT_RETRY_SCHEDULE, LEASE_MARGIN_SECONDS

# How long an endpoint whose visit found nothing claimable comes last in the claim order.
BARREN_FOR = dt.timedelta(seconds=1)
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str = field(default_factory=default_worker_id)
    batch_size: int = 100
    max_in_flight: int = 200
    poll_interval: float = 1.0
    lease_seconds: float = 60.0
    request_timeout: float = 10.0
    retry_schedule: tuple[float, ...] = DEFAULT_RETRY_SCHEDULE
    response_body_cap: int = 64 * 1024
    response_excerpt_bytes: int = 2048
    shutdown_grace: float = 30.0
    retry_jitter: float = DEFAULT_JITTER
    retry_after_max: float = RETRY_AFTER_MAX_SECONDS
    # Pattern -> schedule (OUTBOX_EVENT_TYPE_RETRY); an endpoint's own schedule wins.
    retry_schedule_by_event_type: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    health: health.HealthConfig = field(default_factory=health.HealthConfig)
    # No endpoint may hold more than this share of this worker's slots, so a partner
    # that hangs until the deadline cannot take every slot before its breaker opens.
    endpoint_share: float = 0.5

    @property
    def endpoint_slots(self) -> int:
        return max(1, int(self.max_in_flight * self.endpoint_share))

    @property
    def longest_deadline(self) -> float:
        """Per-endpoint timeouts are cut to this, so an attempt never outlives its lease."""
        return max(self.lease_seconds - LEASE_MARGIN_SECONDS, 0.1)

    # Outcomes that finish within this window are written in one statement (issue 7).
    flush_gather: float = 0.005
    # Outcome writes this close together share one pooled connection (Worker._write_outcomes).
    outcome_linger: float = 0.05
    # A completion that frees a slot the last claim wanted triggers the next claim; it
    # waits this long for more completions (or for `refill` of them) so that one claim
    # refills several slots instead of one query per completion.
    claim_gather: float = 0.01
    # Take fresh deliveries straight from the relay of this process (outbox.relay.Handoff)
    # while this worker has free slots and its last claim found nothing more due.
    take_from_relay: bool = True
    # The relay's next pass waits at most this long for a claim that is running or about
    # to run (Worker.settle), instead of scheduling its deliveries and notifying for one
    # more claim.
    relay_settle: float = 0.02

    @property
    def refill(self) -> int:
        """Freed slots that trigger a claim at once, without waiting for `claim_gather`."""
        return max(1, min(self.batch_size, self.max_in_flight) // 4)


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    id: int
    claim: int  # the fencing token: every write back must match it (delivery/queries.py)
    attempts: int
    max_attempts: int
    endpoint_uid: str
    policy: RetryPolicy
    request: OutgoingRequest
    endpoint_id: int = 0
    endpoint_spotless: bool = False  # at claim time: closed breaker, no recent failure
    event_type: str = ""
    traceparent: str | None = None  # W3C trace context of publish(), for the attempt's span
    hold_ambiguous: bool = False  # an ambiguous outcome is held for a person, not retried


@dataclass(slots=True)
class BatchStats:
    claimed: int = 0
    succeeded: int = 0
    scheduled: int = 0
    dead: int = 0
    held: int = 0
    lost_lease: int = 0

    def add(self, decisions: Sequence[Decision], lost: int) -> None:
        for decision in decisions:
            if decision.state == "succeeded":
                self.succeeded += 1
            elif decision.state == "dead":
                self.dead += 1
            elif decision.state == "held":
                self.held += 1
            else:
                self.scheduled += 1
        self.lost_lease += lost

    def merge(self, other: BatchStats) -> None:
        self.claimed += other.claimed
        self.succeeded += other.succeeded
        self.scheduled += other.scheduled
        self.dead += other.dead
        self.held += other.held
        self.lost_lease += other.lost_lease


def render_body(event_type: str, created_at: dt.datetime, payload_json: str) -> bytes:
    """The Standard Webhooks envelope; the payload text is embedded as stored, not re-encoded."""
    return _envelope(json.dumps(event_type), created_at, payload_json)


def _envelope(type_json: str, created_at: dt.datetime, payload_json: str) -> bytes:
    timestamp = created_at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    return f'{{"type":{type_json},"timestamp":"{timestamp}","data":{payload_json}}}'.encode()


# Shared, read-only: most endpoints have no status overrides and no custom headers.
_NO_OVERRIDES: Mapping[int, Outcome] = types.MappingProxyType({})
_NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})


def _memo(cache: dict[K, T], key: K, compute: Callable[[], T]) -> T:
    """Values derived per claimed row but the same for every row with this key: decrypted
    secrets and headers by ciphertext (decrypting per row would cost more than the
    request), retry policies, event types' JSON. A key changes whenever what it derives
    from does, so entries never go stale; the cache is only bounded."""
    found = cache.get(key)
    if found is None:
        if len(cache) > 10_000:
            cache.clear()
        found = cache[key] = compute()
    return found


def _iso(when: dt.datetime | None) -> str | None:
    return None if when is None else when.isoformat()
