"""Delivery workers: claim due deliveries, POST them outside any transaction, record outcomes.

Flow of one delivery through a worker:

    claim (one statement, commits)  ->  POST (no connection, no lock held)
        ->  outcome buffered  ->  written with others in one statement

Claims are leased: if this process dies, the reaper re-schedules the delivery
once the lease expires. Every claim carries a fencing token (the delivery's claim
number) that every write back must match, so a rescued delivery is never overwritten
by a late worker, not even by this one after it claimed the delivery again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import random
import socket
import types
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from delivery import health, operational, queries
from delivery.http import AttemptResult, OutgoingRequest, send_attempt
from delivery.policy import (
    DEFAULT_JITTER,
    RETRY_AFTER_MAX_SECONDS,
    Decision,
    Outcome,
    RetryPolicy,
    decide,
    exhausted_reason,
    matching_rule,
    parse_status_overrides,
)
from outbox import tracing
from outbox.clock import Clock
from outbox.crypto import SecretBox, SigningKey, signing_key
from outbox.endpoints import decrypt_proxy, secret_context
from outbox.headers import decrypt_headers
from outbox.notify import wait_for_any
from outbox.outage import OUTAGE
from outbox.relay import Capacity
from outbox.settings import DEFAULT_RETRY_SCHEDULE, LEASE_MARGIN_SECONDS

log = logging.getLogger(__name__)
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


@dataclass(slots=True)
class BatchStats:
    claimed: int = 0
    succeeded: int = 0
    scheduled: int = 0
    dead: int = 0
    lost_lease: int = 0

    def add(self, decisions: Sequence[Decision], lost: int) -> None:
        for decision in decisions:
            if decision.state == "succeeded":
                self.succeeded += 1
            elif decision.state == "dead":
                self.dead += 1
            else:
                self.scheduled += 1
        self.lost_lease += lost

    def merge(self, other: BatchStats) -> None:
        self.claimed += other.claimed
        self.succeeded += other.succeeded
        self.scheduled += other.scheduled
        self.dead += other.dead
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


class Worker:
    def __init__(
        self,
        engine: AsyncEngine,
        http: httpx.AsyncClient,
        box: SecretBox,
        clock: Clock,
        config: WorkerConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._engine = engine
        self._http = http
        self._box = box
        self._clock = clock
        self.config = config or WorkerConfig()
        self._rng = rng or random.Random()
        self._keys: dict[str, SigningKey] = {}
        self._headers: dict[str, dict[str, str]] = {}
        self._proxies: dict[str, str] = {}
        # What _prepare derives the same way for every delivery of an endpoint or event
        # type, built once (the drain profile had _prepare at a seventh of worker CPU).
        self._policies: dict[tuple[tuple[float, ...] | None, str, int], RetryPolicy] = {}
        self._type_json: dict[str, str] = {}
        self._pending: list[tuple[ClaimedDelivery, AttemptResult]] = []
        self._results_ready = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._started: set[int] = set()  # deliveries whose request left the pool
        self.stats = BatchStats()
        self._slots_held: collections.Counter[int] = collections.Counter()
        self._health_rows: set[int] = set()
        # What the last claim left wanting (see `run`): endpoints it could take no more of
        # (this worker's share used up, or a health gate), whether every slot was busy, and
        # the earliest moment a health gate opens by itself.
        self._gated: frozenset[int] = frozenset()
        self._capped: frozenset[int] = frozenset()
        self._waiting: frozenset[int] = frozenset()
        self._full = False
        self._finished_while_claiming: list[int] | None = None  # endpoint ids, during a claim
        self._freed = 0
        self._refilled = asyncio.Event()
        self.next_gate_at: dt.datetime | None = None
        self._opening: dt.datetime | None = None  # during a claim (see `claim`)
        self.claims = 0  # claim statements run (the tests count them)
        # Endpoints a recent claim visited without finding anything claimable, set aside
        # until then (health.choose_endpoints puts them last).
        self._barren: dict[int, dt.datetime] = {}
        # Tenants with due work at the last claim, about: with a batch's worth or more, the
        # next claim tries to find its batch from the oldest due rows alone
        # (queries.QUICK_CLAIM_GATES); with fewer, that cannot work.
        self._spread = 1_000_000
        # How each claim round found its endpoints: "quick" or "all" (tests, bench).
        self.gate_paths: collections.Counter[str] = collections.Counter()
        # While `run` runs: its attempts, and whether fresh deliveries may come straight
        # from the relay of this process (see `reserve`).
        self._in_flight: dict[asyncio.Task[None], ClaimedDelivery] = {}
        self._accepting = False
        self._caught_up = False
        self._wake: asyncio.Event | None = None
        self._reserved = 0
        self._claiming = False
        self._claim_waiters: list[asyncio.Future[None]] = []
        self.handed_off = 0  # deliveries taken from the relay without a claim (tests)

    # -- claiming -------------------------------------------------------------------

    async def claim(self, limit: int) -> list[ClaimedDelivery]:
        """Claim up to `limit` due deliveries, within each endpoint's breaker and limits.

        A claim visits at most `limit` endpoints. When some of them had nothing claimable
        (per-key ordering held every due row) and other endpoints were left out, it claims
        again at once with those set aside, so stuck endpoints cannot starve the rest.
        """
        claimed: list[ClaimedDelivery] = []
        # The rounds' earliest gate opening; `next_gate_at` changes once, when the claim is
        # over (whoever reads it meanwhile sees the last claim's answer), and a failed claim
        # leaves no stale wake-up behind.
        self._opening = None
        try:
            for _ in range(3):
                found, retry = await self._claim_round(limit - len(claimed))
                claimed += found
                if len(claimed) >= limit or not retry:
                    break
        finally:
            self.next_gate_at = self._opening
        return claimed

    async def _claim_round(self, limit: int) -> tuple[list[ClaimedDelivery], bool]:
        now = self._clock.now()
        self.claims += 1
        self._barren = {eid: until for eid, until in self._barren.items() if until > now}
        local = self._slots_left()
        async with self._engine.begin() as conn:
            gates = await health.open_gates(
                conn,
                now=now,
                config=self.config.health,
                limit=limit,
                set_aside=self._barren.keys(),
                local_caps=local,
                quick=self._spread >= limit,
            )
            self._spread = gates.spread
            self.gate_paths[gates.path] += 1
            params = gates.params(limit, local, self._barren.keys())
            more = params.pop("more")
            if not params["endpoint_ids"]:
                # Nothing due (or all held: disabled tenants, no budget left).
                self._note_gates(gates, local, {})
                self._note_gate_opening(
                    health.earliest_opening(gates, now=now, config=self.config.health)
                )
                return [], False
            rows = (
                await conn.execute(
                    queries.CLAIM_DUE_DELIVERIES,
                    {
                        "now": now,
                        "limit": limit,
                        "worker_id": self.config.worker_id,
                        "lease_expires_at": now + dt.timedelta(seconds=self.config.lease_seconds),
                        **params,
                    },
                )
            ).all()
            taken = health.claimed_per_endpoint(row.endpoint_id for row in rows)
            self._note_gate_opening(
                await health.close_gates(conn, gates, taken, now=now, config=self.config.health)
            )
        self._note_gates(gates, local, taken)
        served = {row.endpoint_id for row in rows}
        barren = [eid for eid in params["endpoint_ids"] if eid not in served]
        for endpoint_id in barren:
            self._barren[endpoint_id] = now + BARREN_FOR
        return [self._prepare(row, now) for row in rows], bool(barren) and more

    def _note_gate_opening(self, at: dt.datetime | None) -> None:
        """Keep the earliest gate opening seen by this claim's rounds."""
        if at is not None and (self._opening is None or at < self._opening):
            self._opening = at

    def _note_gates(
        self, gates: health.Gates, local: Mapping[int, int], taken: Mapping[int, int]
    ) -> None:
        """What the claim left wanting: endpoints behind a health gate or a capped tenant,
        and endpoints whose share of this worker's slots it used up (or found used up)."""
        self._gated = frozenset(gates.budgets) | frozenset(
            endpoint_id
            for endpoint_id, tenant_id in gates.tenant_of.items()
            if tenant_id in gates.tenant_budgets
        )
        cap = self.config.endpoint_slots
        self._capped = frozenset(
            endpoint_id
            for endpoint_id in {*local, *taken}
            if taken.get(endpoint_id, 0) >= local.get(endpoint_id, cap)
        )

    def _slots_left(self) -> dict[int, int]:
        """Per endpoint with attempts running here: how many more slots it may take."""
        cap = self.config.endpoint_slots
        return {endpoint_id: max(0, cap - held) for endpoint_id, held in self._slots_held.items()}

    def _key(self, stored: str, endpoint_uid: str) -> SigningKey:
        return _memo(
            self._keys,
            stored,
            lambda: signing_key(self._box.decrypt(stored, context=secret_context(endpoint_uid))),
        )

    def _policy(
        self, own: Sequence[float] | None, event_type: str, max_attempts: int
    ) -> RetryPolicy:
        """The endpoint's schedule, else the event type's, else the global one. Max attempts
        were resolved the same way when the delivery was created (the relay)."""
        return _memo(
            self._policies,
            (tuple(own) if own else None, "" if own else event_type, max_attempts),
            lambda: RetryPolicy(
                schedule=tuple(
                    own
                    or matching_rule(self.config.retry_schedule_by_event_type, event_type)
                    or self.config.retry_schedule
                ),
                max_attempts=max_attempts,
                jitter=self.config.retry_jitter,
                retry_after_max=self.config.retry_after_max,
            ),
        )

    def _prepare(self, row: Any, now: dt.datetime) -> ClaimedDelivery:
        keys = [self._key(row.signing_secret, row.endpoint_uid)]
        if row.previous_signing_secret and (
            row.previous_secret_expires_at is None or row.previous_secret_expires_at > now
        ):
            keys.append(self._key(row.previous_signing_secret, row.endpoint_uid))
        timeout = min(
            row.timeout_seconds or self.config.request_timeout, self.config.longest_deadline
        )
        type_json = _memo(self._type_json, row.event_type, lambda: json.dumps(row.event_type))
        return ClaimedDelivery(
            id=row.id,
            claim=row.claim,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            endpoint_uid=row.endpoint_uid,
            endpoint_id=row.endpoint_id,
            endpoint_spotless=row.endpoint_spotless,
            event_type=row.event_type,
            traceparent=row.traceparent,
            policy=self._policy(row.retry_schedule, row.event_type, row.max_attempts),
            request=OutgoingRequest(
                delivery_id=row.id,
                url=row.url,
                message_id=row.message_id,
                body=_envelope(type_json, row.event_created_at, row.payload_json),
                keys=keys,
                timeout=timeout,
                status_overrides=(
                    parse_status_overrides(row.status_overrides)
                    if row.status_overrides
                    else _NO_OVERRIDES
                ),
                retry_after_max=self.config.retry_after_max,
                extra_headers=self._custom_headers(row.custom_headers, row.endpoint_uid),
                proxy=self._proxy(row.proxy_url, row.endpoint_uid) if row.proxy_url else None,
            ),
        )

    def _custom_headers(self, stored: str | None, endpoint_uid: str) -> Mapping[str, str]:
        if not stored:
            return _NO_HEADERS
        return _memo(
            self._headers, stored, lambda: decrypt_headers(self._box, endpoint_uid, stored)
        )

    def _proxy(self, stored: str, endpoint_uid: str) -> str:
        return _memo(self._proxies, stored, lambda: decrypt_proxy(self._box, endpoint_uid, stored))

    # -- attempting and recording ---------------------------------------------------

    async def attempt(self, claimed: ClaimedDelivery) -> AttemptResult:
        span = tracing.start_attempt_span(
            claimed.traceparent,
            event_type=claimed.event_type,
            message_id=claimed.request.message_id,
            delivery_id=claimed.id,
            endpoint_uid=claimed.endpoint_uid,
            attempt=claimed.attempts + 1,
        )
        try:
            result = await send_attempt(
                self._http,
                claimed.request,
                self._clock,
                body_cap=self.config.response_body_cap,
                excerpt_bytes=self.config.response_excerpt_bytes,
                on_start=lambda: self._started.add(claimed.id),
            )
        except BaseException as exc:
            tracing.end_attempt_span(span, outcome="error", status_code=None, error=repr(exc))
            raise
        tracing.end_attempt_span(
            span, outcome=str(result.outcome), status_code=result.status_code, error=result.error
        )
        return result

    async def record(self, outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]]) -> BatchStats:
        """Write a batch of outcomes in one statement; returns what became of them."""
        stats = BatchStats()
        if not outcomes:
            return stats
        now = self._clock.now()
        decisions = [
            decide(
                result.outcome,
                attempts_made=claimed.attempts + 1,
                policy=claimed.policy,
                now=now,
                rng=self._rng,
                last_error=result.error or "",
                retry_after=result.retry_after,
                disables_endpoint=result.disables_endpoint,
            )
            for claimed, result in outcomes
        ]
        # Successes of spotless endpoints change nothing: no health write on the happy path.
        observations = [
            health.Observation(
                claimed.endpoint_id,
                result.outcome,
                result.status_code,
                result.retry_after,
                result.error,
            )
            for claimed, result in outcomes
        ]
        observations = [
            item
            for item, (claimed, _) in zip(observations, outcomes, strict=True)
            if not (claimed.endpoint_spotless and health.is_good_news(item))
        ]
        await health.ensure_health_rows(
            self._engine, (item.endpoint_id for item in observations), self._health_rows
        )
        async with self._engine.begin() as conn:
            decisions = await self._explain_exhausted(conn, outcomes, decisions)
            kept = await self._write_outcome_rows(conn, now, outcomes, decisions)
            await operational.report_dead(
                conn,
                sorted(
                    claimed.id
                    for decision, (claimed, _) in zip(decisions, outcomes, strict=True)
                    if decision.state == "dead" and (claimed.id, claimed.claim) in kept
                ),
                now=now,
            )
            await self._disable_gone_endpoints(conn, now, outcomes)
            # Every attempt that happened informs its endpoint's breaker, kept or not.
            await health.record_observations(
                conn,
                observations,
                now=now,
                config=self.config.health,
                names={claimed.endpoint_id: claimed.endpoint_uid for claimed, _ in outcomes},
            )
        self._log_outcomes(outcomes, decisions, kept)
        lost = len(outcomes) - len(kept)
        if lost:
            log.warning("%d outcomes arrived after their lease was rescued; kept as history", lost)
        stats.claimed = len(outcomes)
        stats.add(
            [
                d
                for d, (claimed, _) in zip(decisions, outcomes, strict=True)
                if (claimed.id, claimed.claim) in kept
            ],
            lost,
        )
        return stats

    def _log_outcomes(
        self,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: Sequence[Decision],
        kept: set[tuple[int, int]],
    ) -> None:
        """One WARNING per delivery that became dead (the state change an operator acts
        on); each failed attempt that will be retried at DEBUG (the summary counts them)."""
        debug = log.isEnabledFor(logging.DEBUG)
        for (claimed, result), decision in zip(outcomes, decisions, strict=True):
            if (claimed.id, claimed.claim) not in kept:
                continue
            if decision.state == "scheduled" and debug:
                log.debug(
                    "delivery %d to endpoint %s, attempt %d failed (%s): %s; retry at %s",
                    claimed.id,
                    claimed.endpoint_uid,
                    claimed.attempts + 1,
                    result.outcome,
                    result.error or "no error text",
                    _iso(decision.next_attempt_at),
                )
            elif decision.state == "dead":
                log.warning(
                    "delivery %d to endpoint %s is dead (attempt %d): %s",
                    claimed.id,
                    claimed.endpoint_uid,
                    claimed.attempts + 1,
                    decision.final_reason or "no reason recorded",
                )

    async def _explain_exhausted(
        self,
        conn: AsyncConnection,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: list[Decision],
    ) -> list[Decision]:
        """Give deliveries that used up their attempts a reason like '8 attempts over 17 h'."""
        exhausted = [
            claimed.id
            for decision, (claimed, _) in zip(decisions, outcomes, strict=True)
            if decision.exhausted
        ]
        if not exhausted:
            return decisions
        rows = await conn.execute(queries.SELECT_FIRST_ATTEMPT_TIMES, {"ids": exhausted})
        first_at = {int(row.delivery_id): row.first_at for row in rows}
        explained = []
        for decision, (claimed, result) in zip(decisions, outcomes, strict=True):
            if decision.exhausted:
                reason = exhausted_reason(
                    claimed.attempts + 1,
                    first_at.get(claimed.id, result.started_at),
                    result.started_at,
                    result.status_code,
                    result.error or "",
                )
                decision = Decision(decision.state, None, reason, exhausted=True)
            explained.append(decision)
        return explained

    async def _disable_gone_endpoints(
        self,
        conn: AsyncConnection,
        now: dt.datetime,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
    ) -> None:
        """410 Gone: disable the endpoint (with a reason) so its other deliveries wait."""
        gone = {
            claimed.endpoint_uid: claimed.request.url
            for claimed, result in outcomes
            if result.disables_endpoint
        }
        if not gone:
            return
        stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        reasons = [
            f"410 Gone from {url} at {stamp}: the receiver says this endpoint no longer "
            "exists; fix or delete it, then enable it to deliver what is waiting"
            for url in gone.values()
        ]
        disabled = (
            await conn.execute(
                queries.DISABLE_GONE_ENDPOINTS,
                {
                    "uids": list(gone),
                    "reasons": reasons,
                    "now": now,
                    "worker_id": self.config.worker_id,
                },
            )
        ).all()
        for row in disabled:
            log.warning("endpoint %s answered 410 Gone and was disabled", row.uid)

    async def _write_outcome_rows(
        self,
        conn: AsyncConnection,
        now: dt.datetime,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: Sequence[Decision],
    ) -> set[tuple[int, int]]:
        """One statement for the whole batch; returns the (id, claim) pairs still current."""
        # One JSON document rather than thirteen arrays: the benchmark's profile put
        # psycopg's array packing at a quarter of the claim-and-record loop.
        rows = [
            {
                "id": claimed.id,
                "claim": claimed.claim,
                "state": decision.state,
                "attempts": claimed.attempts + 1,
                "next_attempt_at": _iso(decision.next_attempt_at),
                "status_code": result.status_code,
                "error": result.error,
                "final_reason": decision.final_reason,
                "started_at": _iso(result.started_at),
                "duration_ms": result.duration_ms,
                "outcome": str(result.outcome),
                "response_excerpt": result.response_excerpt,
                # Already without secrets: custom header values are redacted at the source.
                "request_headers": result.request_headers,
            }
            for (claimed, result), decision in zip(outcomes, decisions, strict=True)
        ]
        params = {
            "now": now,
            "worker_id": self.config.worker_id,
            "outcomes": json.dumps(rows),
        }
        return {(row.id, row.claims) for row in await conn.execute(queries.RECORD_OUTCOMES, params)}

    async def release(self, claims: Sequence[ClaimedDelivery]) -> int:
        """Hand claims back without spending an attempt (used at shutdown)."""
        if not claims:
            return 0
        async with self._engine.begin() as conn:
            released = (
                await conn.execute(
                    queries.RELEASE_CLAIMS,
                    {
                        "ids": [item.id for item in claims],
                        "claims": [item.claim for item in claims],
                        "worker_id": self.config.worker_id,
                        "now": self._clock.now(),
                    },
                )
            ).all()
        return len(released)

    async def run_once(self) -> BatchStats:
        """Claim one batch, attempt every delivery in it concurrently, record the outcomes."""
        claimed = await self.claim(min(self.config.batch_size, self.config.max_in_flight))
        results = await asyncio.gather(*(self.attempt(item) for item in claimed))
        return await self.record(list(zip(claimed, results, strict=True)))

    # -- the long-running loop ------------------------------------------------------

    async def run(self, stop: asyncio.Event, wakeup: asyncio.Event | None = None) -> None:
        """Keep up to max_in_flight attempts running until `stop`; then drain and exit.

        The next claim happens when there is reason to expect work it can take:
        the last claim came back full (claim again at once), a NOTIFY says new
        deliveries are due, a completion freed a slot the last claim wanted (the
        worker was full, or the delivery's endpoint had used up its share of slots or
        its health gate), or a health gate opens by itself (a pause or cooldown
        ends, a token refills). Completions are batched: the claim waits up to
        `claim_gather` for `refill` of them. The poll interval is only the safety net
        (other processes' completions, a missed notification).
        """
        wake = wakeup or asyncio.Event()
        in_flight: dict[asyncio.Task[None], ClaimedDelivery] = {}
        self._in_flight, self._wake, self._accepting = in_flight, wake, True
        closing = asyncio.Event()
        writer = asyncio.create_task(self._write_outcomes(closing), name="outcome-writer")
        try:
            while not stop.is_set():
                free = self.config.max_in_flight - len(in_flight) - self._reserved
                if free > 0:
                    wake.clear()
                    self._slot_free.clear()
                    self._refilled.clear()
                    self._freed = 0
                    want = min(self.config.batch_size, free)
                    self._finished_while_claiming = []
                    self._caught_up = False
                    self._claiming = True
                    try:
                        claimed = await self.claim(want)
                        OUTAGE.succeeded()
                        # Nothing more was due that this worker could take: fresh
                        # deliveries may come straight from the relay until a claim
                        # is due again.
                        self._caught_up = len(claimed) < want
                    except Exception as exc:
                        OUTAGE.failed("worker claim", exc)
                        claimed = []
                    finally:
                        meanwhile, self._finished_while_claiming = (
                            self._finished_while_claiming,
                            None,
                        )
                        self._claiming = False
                        self._claim_settled()
                    self._start(claimed)
                    self._waiting = self._gated | self._capped
                    # Slots freed while the claim ran, of endpoints it has just found wanting.
                    for endpoint_id in meanwhile:
                        if endpoint_id in self._waiting:
                            self._note_freed()
                    if len(claimed) == want and not self._full:
                        continue  # a full batch: more may be due
                await wait_for_any(stop, wake, self._slot_free, timeout=self._idle_timeout())
                if self._slot_free.is_set() and not (wake.is_set() or stop.is_set()):
                    await wait_for_any(stop, wake, self._refilled, timeout=self.config.claim_gather)
        finally:
            self._accepting = False
            await self._drain(in_flight)
            # Never cancel the writer mid-write: tell it to finish what is buffered.
            closing.set()
            self._results_ready.set()
            await writer

    def _start(self, claimed: Sequence[ClaimedDelivery]) -> None:
        """Start the attempts of claimed deliveries (in `run`), each holding a slot."""
        in_flight = self._in_flight
        for item in claimed:
            task = asyncio.create_task(self._attempt_and_buffer(item))
            in_flight[task] = item
            self._slots_held[item.endpoint_id] += 1
            task.add_done_callback(lambda done: self._finished(in_flight, done))
        self._full = len(in_flight) >= self.config.max_in_flight

    # -- taking fresh deliveries from the relay (outbox.relay.Handoff) ----------------

    @property
    def taking_from_relay(self) -> bool:
        """`run` runs and its last claim found nothing more due (see `reserve`)."""
        return self._accepting and self._caught_up

    async def settle(self) -> None:
        """Before the relay reserves: let a claim that runs, or that a pending wake-up is
        about to start, finish first (at most `relay_settle`).

        Its verdict then decides the handoff. Otherwise a relay pass that overlaps a claim
        schedules its deliveries and notifies, which starts another claim, which the next
        pass overlaps: at a steady trickle most deliveries would take a claim transaction.
        """
        if not (self.config.take_from_relay and self._accepting):
            return
        pending = self._wake is not None and self._wake.is_set()
        free = self.config.max_in_flight - len(self._in_flight) - self._reserved
        if not (self._claiming or (pending and free > 0)):
            return
        settled = asyncio.get_running_loop().create_future()
        self._claim_waiters.append(settled)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled, self.config.relay_settle)

    def _claim_settled(self) -> None:
        waiters, self._claim_waiters = self._claim_waiters, []
        for settled in waiters:
            if not settled.done():
                settled.set_result(None)

    def reserve(self) -> Capacity | None:
        """Free slots the relay of this process may fill with deliveries it inserts
        already claimed for this worker, or None.

        Only while `run` runs and its last claim found nothing more due (so nothing
        that waits longer is overtaken: fairness and priorities stay the claim's) and no
        wake-up is pending. The slots stay reserved until `take`.
        """
        if not (self.config.take_from_relay and self.taking_from_relay):
            return None
        if self._wake is not None and self._wake.is_set():
            return None
        free = self.config.max_in_flight - len(self._in_flight) - self._reserved
        limit = min(self.config.batch_size, free)
        if limit <= 0:
            return None
        self._reserved += limit
        now = self._clock.now()
        return Capacity(
            limit=limit,
            worker_id=self.config.worker_id,
            lease_expires_at=now + dt.timedelta(seconds=self.config.lease_seconds),
            endpoint_slots=self.config.endpoint_slots,
            slots_left=self._slots_left(),
        )

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        """Attempt the deliveries the relay handed off (claimed for this worker, claim
        number and lease included), freeing the reservation `capacity`. After `run`
        stopped they are handed back at once, like unstarted claims at shutdown."""
        self._reserved = max(0, self._reserved - capacity.limit)
        if not rows:
            return
        claimed = [self._prepare(row, now) for row in rows]
        self.handed_off += len(claimed)
        if not self._accepting:
            await self._release_at_shutdown(claimed)
            return
        self._start(claimed)

    def _idle_timeout(self) -> float:
        """The poll interval, or less when a health gate opens sooner."""
        timeout = self.config.poll_interval
        if self.next_gate_at is not None:
            until_open = (self.next_gate_at - self._clock.now()).total_seconds()
            timeout = min(timeout, max(until_open, self.config.claim_gather))
        return timeout

    def _finished(
        self, in_flight: dict[asyncio.Task[None], ClaimedDelivery], task: asyncio.Task[None]
    ) -> None:
        item = in_flight.pop(task, None)
        if item is None:
            return
        self._slots_held[item.endpoint_id] -= 1
        if self._slots_held[item.endpoint_id] <= 0:
            del self._slots_held[item.endpoint_id]
        if self._finished_while_claiming is not None:
            self._finished_while_claiming.append(item.endpoint_id)
        if self._full or item.endpoint_id in self._waiting:
            # A slot the last claim could not fill is free: that claim left work behind.
            self._note_freed()

    def _note_freed(self) -> None:
        self._freed += 1
        self._slot_free.set()
        if self._freed >= self.config.refill:
            self._refilled.set()

    async def _attempt_and_buffer(self, claimed: ClaimedDelivery) -> None:
        try:
            result = await self.attempt(claimed)
        except Exception:
            # A bug, not a delivery outcome (those are values). The claim is left to lease
            # expiry and the reaper, whose rescue count stops a delivery that keeps doing this.
            log.exception(
                "attempt of delivery %d failed unexpectedly; left to the reaper", claimed.id
            )
            return
        finally:
            self._started.discard(claimed.id)
        self._pending.append((claimed, result))
        self._results_ready.set()

    async def _write_outcomes(self, closing: asyncio.Event) -> None:
        """Write outcomes as they arrive (batching whatever piled up meanwhile) until closing."""
        while True:
            await self._results_ready.wait()
            await asyncio.sleep(self.config.flush_gather)  # let a batch build up
            self._results_ready.clear()
            await self._flush_all()
            if closing.is_set() and not self._pending:
                return

    async def _flush_all(self) -> None:
        """Write every buffered outcome; on a database error keep them and try again."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                self.stats.merge(await self.record(batch))
                OUTAGE.succeeded()
            except asyncio.CancelledError:
                self._pending[:0] = batch
                raise
            except Exception as exc:
                OUTAGE.failed(f"recording {len(batch)} outcomes", exc)
                self._pending[:0] = batch
                await asyncio.sleep(self.config.poll_interval)

    async def _drain(self, in_flight: dict[asyncio.Task[None], ClaimedDelivery]) -> None:
        """Hand back queued claims at once, let running attempts finish, release the rest.

        A claim whose request has not left the connection pool yet sent nothing, so it
        is cancelled and released immediately (no attempt spent, due again at once)
        instead of waiting for the shutdown grace or its lease to run out. Running
        attempts are bounded by their deadline.
        """
        if not in_flight:
            return
        queued = {task: item for task, item in in_flight.items() if item.id not in self._started}
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        handed_back = [item for task, item in queued.items() if task.cancelled()]
        if handed_back:
            released = await self._release_at_shutdown(handed_back)
            log.info("shutdown: released %d claimed deliveries that had not started", released)
        if not in_flight:
            return
        _, unfinished = await asyncio.wait(list(in_flight), timeout=self.config.shutdown_grace)
        leftovers = [in_flight[task] for task in unfinished]
        for task in unfinished:
            task.cancel()
        if leftovers:
            released = await self._release_at_shutdown(leftovers)
            log.info("shutdown: released %d unfinished deliveries", released)

    async def _release_at_shutdown(self, claims: Sequence[ClaimedDelivery]) -> int:
        """Hand claims back; with the database away, leave them to the reaper (lease expiry)."""
        try:
            return await self.release(claims)
        except Exception as exc:
            OUTAGE.failed(
                f"releasing {len(claims)} claims at shutdown (the reaper takes them)", exc
            )
            return 0


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
