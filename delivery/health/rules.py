"""Endpoint health: circuit breakers, per-endpoint limits, and the gate every claim passes.

One bad partner must never hurt the others. The state lives in `endpoint_health`
(one row per endpoint, created on first use), so every worker process shares it:

    closed --(N consecutive failures, or failure ratio over a window)--> open
    open --(cooldown passed: one probe claimed)--> half_open
    half_open --(probe answered)--> closed, then the backlog ramps up
    half_open --(probe failed)--> open again, with a longer cooldown (capped)

While open, an endpoint's deliveries are not claimed, so they spend no attempts.
After closing, its rate is capped by a ramp (start + step * seconds since closing)
until the ramp ends. A 429 pauses the endpoint (Retry-After, or a default) and
restarts the ramp from the end of the pause. An endpoint whose attempts have all
failed for `auto_disable_after` is disabled with a reason; its deliveries wait.

A claim first locks the health rows of *gated* endpoints (a breaker not closed,
limits set, a ramp or a pause running) with SKIP LOCKED: a second worker claiming
at the same moment skips those endpoints instead of overrunning their limits. The
limits count what is in flight in the database, so they hold across processes.

Outcomes update the rows in the transaction that records them, locked in id order.
The happy path writes nothing: the claim reports whether an endpoint is spotless
(closed, no failure in its window, no streak, no past trips), and answers from a
spotless endpoint change nothing, so the worker skips them. That is also why the
ratio window opens with a failure and counts the answers from then on.

The decisions are pure functions of a `Health` value, a clock reading and the
config (unit-tested without a database); the SQL only loads, locks and saves.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from delivery import queries
from delivery.policy import Outcome
from outbox.audit import record_audit
from outbox.endpoints import get_endpoint
from outbox.errors import EndpointError

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
THROTTLE_STATUS = 429


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Breaker and ramp settings shared by all endpoints (limits are per endpoint)."""

    failure_threshold: int = 5
    failure_ratio: float = 0.5
    ratio_window_seconds: float = 60.0
    ratio_min_attempts: int = 20
    cooldown_seconds: float = 15.0
    cooldown_max_seconds: float = 600.0
    ramp_seconds: float = 60.0
    ramp_start_per_second: float = 1.0
    ramp_step_per_second: float = 1.0
    throttle_seconds: float = 5.0
    auto_disable_after_seconds: float = 5 * 86400.0
    probe_lease_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class Health:
    """One endpoint_health row (breaker state and limits)."""

    endpoint_id: int
    max_in_flight: int | None = None
    max_per_second: float | None = None
    breaker_state: str = CLOSED
    consecutive_failures: int = 0
    window_started_at: dt.datetime | None = None
    window_attempts: int = 0
    window_failures: int = 0
    trips: int = 0
    opened_at: dt.datetime | None = None
    open_until: dt.datetime | None = None
    probe_until: dt.datetime | None = None
    ramp_started_at: dt.datetime | None = None
    ramp_until: dt.datetime | None = None
    paused_until: dt.datetime | None = None
    tokens: float | None = None
    tokens_at: dt.datetime | None = None
    failing_since: dt.datetime | None = None
    last_failure: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> Health:
        values = row._mapping
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


STATE_FIELDS = tuple(
    f.name for f in dataclasses.fields(Health) if f.name not in ("max_in_flight", "max_per_second")
)


# -- the claim gate ---------------------------------------------------------------------


def effective_rate(health: Health, now: dt.datetime, config: HealthConfig) -> float | None:
    """Requests per second allowed now: the endpoint's limit, lowered by a running ramp."""
    rate = health.max_per_second
    started, until = health.ramp_started_at, health.ramp_until
    if started is not None and until is not None and started <= now < until:
        elapsed = (now - started).total_seconds()
        ramp = config.ramp_start_per_second + config.ramp_step_per_second * elapsed
        rate = ramp if rate is None else min(rate, ramp)
    return rate


def available_tokens(health: Health, now: dt.datetime, rate: float) -> float:
    """Token bucket refill; the bucket holds one second's worth (at least one request)."""
    burst = max(1.0, rate)
    if health.tokens is None or health.tokens_at is None:
        return burst
    elapsed = max(0.0, (now - health.tokens_at).total_seconds())
    return min(burst, health.tokens + rate * elapsed)


def claim_budget(
    health: Health, *, in_flight: int, now: dt.datetime, config: HealthConfig
) -> int | None:
    """How many deliveries of this endpoint one claim may take right now (None: no limit)."""
    if health.paused_until is not None and now < health.paused_until:
        return 0
    budget = math.inf
    if health.max_in_flight is not None:
        budget = max(0, health.max_in_flight - in_flight)
    if health.breaker_state == OPEN:
        if health.open_until is not None and now < health.open_until:
            return 0
        return int(min(budget, 1))  # cooldown over: one probe
    if health.breaker_state == HALF_OPEN:
        if health.probe_until is not None and now < health.probe_until:
            return 0  # the probe is still out
        return int(min(budget, 1))  # the probe's worker vanished: probe again
    rate = effective_rate(health, now, config)
    if rate is not None:
        budget = min(budget, math.floor(available_tokens(health, now, rate)))
    return None if budget == math.inf else int(budget)


def after_claim(health: Health, claimed: int, *, now: dt.datetime, config: HealthConfig) -> Health:
    """The row after a claim took `claimed` deliveries of this endpoint."""
    changes: dict[str, Any] = {}
    if health.breaker_state in (OPEN, HALF_OPEN):
        if claimed:
            changes.update(
                breaker_state=HALF_OPEN,
                probe_until=now + dt.timedelta(seconds=config.probe_lease_seconds),
            )
        return dataclasses.replace(health, **changes)
    rate = effective_rate(health, now, config)
    if rate is None:
        changes.update(tokens=None, tokens_at=None)
    else:
        changes.update(tokens=available_tokens(health, now, rate) - claimed, tokens_at=now)
    if health.ramp_until is not None and now >= health.ramp_until:
        changes.update(ramp_started_at=None, ramp_until=None)
    if health.paused_until is not None and now >= health.paused_until:
        changes.update(paused_until=None)
    return dataclasses.replace(health, **changes)


# -- outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """What one attempt says about its endpoint's health."""

    endpoint_id: int
    outcome: Outcome
    status_code: int | None
    retry_after: float | None
    error: str | None


@dataclass(slots=True)
class Summary:
    """One endpoint's attempts from one outcome batch, in the order they finished."""

    answered: int = 0  # the endpoint responded (2xx, or a definite 3xx/4xx rejection)
    failures: int = 0  # 5xx, 408/425, connect errors, timeouts
    trailing_failures: int = 0  # failures after the last answer
    throttled_for: float | None = None  # 429: seconds to pause
    last_error: str | None = None


def is_failure(observation: Observation) -> bool:
    return observation.outcome in (Outcome.RETRYABLE, Outcome.AMBIGUOUS) and (
        observation.status_code != THROTTLE_STATUS
    )


def is_good_news(observation: Observation) -> bool:
    """An answer (not a failure, not a 429): for a spotless endpoint it changes nothing."""
    return not is_failure(observation) and observation.status_code != THROTTLE_STATUS


def summarize(observations: Iterable[Observation], config: HealthConfig) -> dict[int, Summary]:
    summaries: dict[int, Summary] = {}
    for item in observations:
        summary = summaries.setdefault(item.endpoint_id, Summary())
        if item.status_code == THROTTLE_STATUS:
            pause = item.retry_after if item.retry_after is not None else config.throttle_seconds
            summary.throttled_for = max(summary.throttled_for or 0.0, pause)
        elif is_failure(item):
            summary.failures += 1
            summary.trailing_failures += 1
            summary.last_error = item.error
        elif item.outcome is Outcome.SUCCEEDED or item.status_code is not None:
            summary.answered += 1
            summary.trailing_failures = 0
        # A permanent refusal without a response (the SSRF guard) says nothing about health.
    return summaries


def cooldown(trips: int, config: HealthConfig) -> float:
    """Open time after the `trips`-th consecutive trip: doubling from the base, capped."""
    return min(config.cooldown_max_seconds, config.cooldown_seconds * 2.0 ** max(0, trips - 1))


def _trip(health: Health, now: dt.datetime, config: HealthConfig) -> Health:
    trips = health.trips + 1
    return dataclasses.replace(
        health,
        breaker_state=OPEN,
        trips=trips,
        opened_at=now,
        open_until=now + dt.timedelta(seconds=cooldown(trips, config)),
        probe_until=None,
        window_started_at=None,
        window_attempts=0,
        window_failures=0,
        ramp_started_at=None,
        ramp_until=None,
        tokens=None,
        tokens_at=None,
    )


def _close(health: Health, now: dt.datetime, config: HealthConfig) -> Health:
    return dataclasses.replace(
        health,
        breaker_state=CLOSED,
        consecutive_failures=0,
        open_until=None,
        probe_until=None,
        window_started_at=now,
        window_attempts=0,
        window_failures=0,
        ramp_started_at=now,
        ramp_until=now + dt.timedelta(seconds=config.ramp_seconds),
        tokens=None,
        tokens_at=None,
    )


def after_outcomes(
    health: Health, summary: Summary, *, now: dt.datetime, config: HealthConfig
) -> Health:
    """The row after a batch of this endpoint's outcomes was recorded."""
    h = health
    if summary.throttled_for is not None:
        # Slow down: pause, then ramp up again from the end of the pause.
        until = now + dt.timedelta(seconds=summary.throttled_for)
        if h.paused_until is not None:
            until = max(until, h.paused_until)
        h = dataclasses.replace(
            h,
            paused_until=until,
            ramp_started_at=until,
            ramp_until=until + dt.timedelta(seconds=config.ramp_seconds),
            tokens=None,
            tokens_at=None,
        )
    # The failure streak that auto-disable measures.
    if summary.answered:
        failing_since = now if summary.trailing_failures else None
        h = dataclasses.replace(h, failing_since=failing_since)
    elif summary.failures and h.failing_since is None:
        h = dataclasses.replace(h, failing_since=now)
    if summary.failures:
        h = dataclasses.replace(h, last_failure=summary.last_error)

    if h.breaker_state == HALF_OPEN:
        if summary.answered and not summary.trailing_failures:
            return _close(h, now, config)
        if summary.failures:
            return _trip(h, now, config)
        if summary.throttled_for is not None:
            # The probe was throttled: probe again when the pause ends, no longer cooldown.
            return dataclasses.replace(
                h, breaker_state=OPEN, open_until=h.paused_until, probe_until=None
            )
        return h
    if h.breaker_state == OPEN:
        return h  # stragglers claimed before the trip; the probe decides

    # Closed: count, and trip on a run of failures or a bad ratio over the window.
    attempts = summary.answered + summary.failures
    window_started_at, window_attempts, window_failures = (
        h.window_started_at,
        h.window_attempts,
        h.window_failures,
    )
    if window_started_at is None or (now - window_started_at).total_seconds() >= (
        config.ratio_window_seconds
    ):
        # A window opens with a failure: answers while nothing fails are not written
        # at all (the worker skips them), so the ratio counts from the first failure.
        window_started_at, window_attempts, window_failures = now, 0, 0
        if not summary.failures:
            window_started_at = None
    if window_started_at is not None:
        window_attempts += attempts
        window_failures += summary.failures
    consecutive = (
        summary.trailing_failures if summary.answered else h.consecutive_failures + summary.failures
    )
    h = dataclasses.replace(
        h,
        consecutive_failures=consecutive,
        window_started_at=window_started_at,
        window_attempts=window_attempts,
        window_failures=window_failures,
    )
    ratio_tripped = (
        window_attempts >= config.ratio_min_attempts
        and window_failures >= config.failure_ratio * window_attempts
    )
    if consecutive >= config.failure_threshold or ratio_tripped:
        return _trip(h, now, config)
    if summary.answered and h.trips and (h.ramp_until is None or now >= h.ramp_until):
        h = dataclasses.replace(h, trips=0)  # healthy through a whole ramp: forgive old trips
    return h


def disable_reason(health: Health, *, now: dt.datetime, config: HealthConfig) -> str | None:
    """Why the endpoint should be disabled now, or None while it still has a chance."""
    if health.failing_since is None:
        return None
    failing_for = (now - health.failing_since).total_seconds()
    if failing_for < config.auto_disable_after_seconds:
        return None
    since = health.failing_since.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"auto-disabled: every attempt failed for {_duration(failing_for)} (since {since}); "
        f"last error: {health.last_failure or 'unknown'}. Pending deliveries are kept: fix the "
        "endpoint, then enable it again"
    )


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:g} days"
    if seconds >= 3600:
        return f"{seconds / 3600:g} hours"
    return f"{seconds:g} seconds"


# -- the database side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantCap:
    """A capped tenant's limits and token bucket, as one claim saw them (locked)."""

    tenant_id: int
    max_in_flight: int | None = None
    max_per_second: float | None = None
    tokens: float | None = None
    tokens_at: dt.datetime | None = None


def tenant_budget(cap: TenantCap, *, in_flight: int, now: dt.datetime) -> int | None:
    """How many of this tenant's deliveries one claim may take now, across its endpoints."""
    budget = math.inf
    if cap.max_in_flight is not None:
        budget = max(0, cap.max_in_flight - in_flight)
    if cap.max_per_second is not None:
        bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
        budget = min(budget, math.floor(available_tokens(bucket, now, cap.max_per_second)))
    return None if budget == math.inf else int(budget)


def tenant_after_claim(cap: TenantCap, claimed: int, *, now: dt.datetime) -> TenantCap:
    """The bucket after a claim took `claimed` of the tenant's deliveries."""
    if cap.max_per_second is None:
        return cap
    bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
    tokens = available_tokens(bucket, now, cap.max_per_second) - claimed
    return dataclasses.replace(cap, tokens=tokens, tokens_at=now)


def tenant_next_opening(cap: TenantCap, *, now: dt.datetime) -> dt.datetime | None:
    """When a tenant capped per second may take one more, if its bucket alone holds it
    back (None: no rate cap, or a token is there: an in-flight cap waits for an outcome)."""
    if cap.max_per_second is None:
        return None
    bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
    tokens = available_tokens(bucket, now, cap.max_per_second)
    if tokens >= 1:
        return None
    return now + dt.timedelta(seconds=(1 - tokens) / cap.max_per_second)


@dataclass(frozen=True, slots=True)
class Head:
    """An endpoint's first due delivery in claim order, as the gates saw it."""

    endpoint_id: int
    tenant_id: int
    priority: int
    due_at: dt.datetime
    delivery_id: int


def choose_endpoints(
    heads: Sequence[Head],
    budgets: Mapping[int, int],
    tenant_budgets: Mapping[int, int],
    limit: int,
    set_aside: Collection[int] = frozenset(),
) -> tuple[list[int], bool]:
    """The endpoints one claim visits: at most `limit`, in the claim's own order, so the
    claim's cost follows its batch size, not the number of endpoints with due work; and
    whether more endpoints were eligible than chosen.

    The order is the claim's: priority first, then round robin across tenants (each
    tenant's endpoints take turns by their heads' age), then the oldest head. An endpoint
    served by this claim moves its head to a newer row, so the next claim rotates on to
    the endpoints that waited. Endpoints or tenants with no budget left are not visited.
    `set_aside` endpoints (a recent visit found nothing claimable: per-key ordering held
    every due row) come last, so stuck endpoints never crowd out the others.
    """
    eligible = [
        h
        for h in heads
        if budgets.get(h.endpoint_id, 1) > 0 and tenant_budgets.get(h.tenant_id, 1) > 0
    ]
    eligible.sort(key=lambda h: (h.tenant_id, -h.priority, h.due_at, h.delivery_id))
    turns: Counter[tuple[int, int]] = Counter()
    turn: dict[int, int] = {}
    for head in eligible:
        turns[head.tenant_id, head.priority] += 1
        turn[head.endpoint_id] = turns[head.tenant_id, head.priority]
    eligible.sort(
        key=lambda h: (
            h.endpoint_id in set_aside,
            -h.priority,
            turn[h.endpoint_id],
            h.due_at,
            h.delivery_id,
        )
    )
    return [h.endpoint_id for h in eligible[:limit]], len(eligible) > limit


# The quick path walks this many due rows per endpoint of the batch, at most: enough to
# meet a batch's worth of tenants when their due rows are interleaved, even unevenly.
QUICK_WALK = 4


@dataclass(frozen=True, slots=True)
class Gates:
    """What one claim may take: the heads of the endpoints with due work (enabled, of
    enabled tenants), budgets of gated endpoints and capped tenants (others: unlimited).

    On the quick path (`open_gates` with a limit), `batch` holds the chosen endpoints,
    none of them gated, and `heads` nothing; otherwise `heads` holds every candidate."""

    budgets: dict[int, int]
    locked: dict[int, Health]
    heads: list[Head] = dataclasses.field(default_factory=list)
    tenant_budgets: dict[int, int] = dataclasses.field(default_factory=dict)
    tenants_locked: dict[int, TenantCap] = dataclasses.field(default_factory=dict)
    tenant_of: dict[int, int] = dataclasses.field(default_factory=dict)
    more: bool = False  # eligible endpoints were left out of `heads` (quick: maybe)
    spread: int = 0  # tenants with due work, at least (whether the quick path may apply)
    path: str = "all"  # "quick": QUICK_CLAIM_GATES found the batch; "all": every candidate
    batch: list[int] | None = None  # the quick path's batch, in claim order (no `heads`)

    def params(
        self,
        limit: int,
        local_caps: Mapping[int, int] | None = None,
        set_aside: Collection[int] = frozenset(),
    ) -> dict[str, Any]:
        """Claim parameters; `local_caps` lowers budgets further (this worker's slot share).
        `more` (not a statement parameter) says whether eligible endpoints were left out."""
        budgets = dict(self.budgets)
        for endpoint_id, cap in (local_caps or {}).items():
            budgets[endpoint_id] = min(budgets.get(endpoint_id, cap), cap)
        if self.batch is not None:
            # QUICK_CLAIM_GATES chose it as choose_endpoints would (without the endpoints
            # this worker has no slot for), so nothing was left out of it
            chosen, more = self.batch[:limit], False
        else:
            chosen, more = choose_endpoints(
                self.heads, budgets, self.tenant_budgets, limit, set_aside
            )
        more = more or self.more
        # About twice each endpoint's fair share of the batch: enough to fill it when some
        # endpoints have less due, few enough that many busy endpoints lock few rows each.
        per_endpoint = max(1, math.ceil(2 * limit / max(1, len(chosen))))
        return {
            "more": more,
            "endpoint_ids": chosen,
            "per_endpoint": per_endpoint,
            "gate_ids": list(budgets),
            "gate_budgets": list(budgets.values()),
            "tenant_gate_ids": list(self.tenant_budgets),
            "tenant_gate_budgets": list(self.tenant_budgets.values()),
        }


async def open_gates(
    conn: AsyncConnection,
    *,
    now: dt.datetime,
    config: HealthConfig,
    limit: int | None = None,
    set_aside: Collection[int] = frozenset(),
    local_caps: Mapping[int, int] | None = None,
    quick: bool = True,
) -> Gates:
    """Find the endpoints with scheduled work; lock the gated endpoints' health rows and the
    capped tenants' rows (SKIP LOCKED) and work out each one's claim budget.

    An endpoint or tenant whose row another worker holds gets budget 0 for this claim:
    that worker is spending its limits right now.

    With a `limit` (and the `set_aside` and `local_caps` that `Gates.params` will get),
    it first tries to find the claim's batch from the oldest due rows alone
    (queries.QUICK_CLAIM_GATES): when that applies, `batch` holds the same endpoints
    `choose_endpoints` would pick from every candidate (and `heads` nothing), read at the cost
    of a batch rather than of every endpoint with due work. Worth trying while a batch's
    worth of tenants have work (the last claim's `spread`): `quick` says whether to try.
    """
    if quick and limit is not None and limit > 0:
        gates = await _quick_gates(
            conn, now=now, limit=limit, set_aside=set_aside, local_caps=local_caps
        )
        if gates is not None:
            return gates
    budgets: dict[int, int] = {}
    locked: dict[int, Health] = {}
    heads: list[Head] = []
    locked_ids: list[int] = []
    tenant_budgets: dict[int, int] = {}
    tenants_locked: dict[int, TenantCap] = {}
    tenant_of: dict[int, int] = {}
    for row in await conn.execute(queries.LOCK_CLAIM_GATES, {"now": now}):
        heads.append(
            Head(row.endpoint_id, row.tenant_id, row.head_priority, row.head_due_at, row.head_id)
        )
        tenant_of[row.endpoint_id] = row.tenant_id
        if row.gated:
            if row.locked:
                locked_ids.append(row.endpoint_id)
            else:
                budgets[row.endpoint_id] = 0
        if row.tenant_capped:
            if row.tenant_locked:
                tenants_locked[row.tenant_id] = TenantCap(
                    row.tenant_id,
                    row.tenant_max_in_flight,
                    row.tenant_max_per_second,
                    row.tenant_tokens,
                    row.tenant_tokens_at,
                )
            else:
                tenant_budgets[row.tenant_id] = 0
    if locked_ids:
        result = await conn.execute(queries.SELECT_LOCKED_HEALTH, {"ids": locked_ids})
        locked = {row.endpoint_id: Health.from_row(row) for row in result}
    in_flight: dict[int, int] = {}
    counted = [h.endpoint_id for h in locked.values() if h.max_in_flight is not None]
    if counted:
        result = await conn.execute(queries.COUNT_IN_FLIGHT, {"ids": counted})
        in_flight = {row.endpoint_id: int(row.in_flight) for row in result}
    for endpoint_id, health in locked.items():
        budget = claim_budget(
            health, in_flight=in_flight.get(endpoint_id, 0), now=now, config=config
        )
        if budget is not None:
            budgets[endpoint_id] = budget
    tenant_in_flight: dict[int, int] = {}
    counted = [c.tenant_id for c in tenants_locked.values() if c.max_in_flight is not None]
    if counted:
        result = await conn.execute(queries.COUNT_TENANT_IN_FLIGHT, {"ids": counted})
        tenant_in_flight = {row.tenant_id: int(row.in_flight) for row in result}
    for tenant_id, cap in tenants_locked.items():
        tenant_cap = tenant_budget(cap, in_flight=tenant_in_flight.get(tenant_id, 0), now=now)
        if tenant_cap is not None:
            tenant_budgets[tenant_id] = tenant_cap
    return Gates(
        budgets=budgets,
        locked=locked,
        heads=heads,
        tenant_budgets=tenant_budgets,
        tenants_locked=tenants_locked,
        tenant_of=tenant_of,
        spread=len(set(tenant_of.values())),
    )


async def _quick_gates(
    conn: AsyncConnection,
    *,
    now: dt.datetime,
    limit: int,
    set_aside: Collection[int],
    local_caps: Mapping[int, int] | None,
) -> Gates | None:
    """The claim's batch from queries.QUICK_CLAIM_GATES, or None when it cannot tell."""
    row = (
        await conn.execute(
            queries.QUICK_CLAIM_GATES,
            {
                "now": now,
                "limit": limit,
                "walk": QUICK_WALK * limit,
                "set_aside": list(set_aside),
                "excluded": [eid for eid, cap in (local_caps or {}).items() if cap <= 0],
            },
        )
    ).one()
    batch: list[int] = row.endpoint_ids or []
    if len(batch) < limit or not row.plain:
        return None
    return Gates(
        budgets={},
        locked={},
        tenant_of=dict(zip(batch, row.tenant_ids, strict=True)),
        # more due rows at this priority than the batch took, or work at a lower one
        more=row.walked > limit or row.lower,
        spread=row.spread,
        path="quick",
        batch=batch,
    )


async def close_gates(
    conn: AsyncConnection,
    gates: Gates,
    claimed: Mapping[int, int],
    *,
    now: dt.datetime,
    config: HealthConfig,
) -> dt.datetime | None:
    """Charge what the claim took to the locked rows (tokens, probe), in the claim's transaction.

    Returns the earliest moment one of these endpoints' or tenants' gates opens again by
    itself (a pause or cooldown ending, a token refilling), so the worker can claim then
    instead of at its next poll.
    """
    changed = []
    openings = []
    for endpoint_id, health in gates.locked.items():
        updated = after_claim(health, claimed.get(endpoint_id, 0), now=now, config=config)
        if updated != health:
            changed.append(updated)
        opening = next_opening(updated, now=now, config=config)
        if opening is not None:
            openings.append(opening)
    await save(conn, changed, now=now)
    per_tenant: Counter[int] = Counter()
    for endpoint_id, count in claimed.items():
        per_tenant[gates.tenant_of.get(endpoint_id, 0)] += count
    buckets = [
        tenant_after_claim(cap, per_tenant[tenant_id], now=now)
        for tenant_id, cap in gates.tenants_locked.items()
        if cap.max_per_second is not None
    ]
    openings += [at for b in buckets if (at := tenant_next_opening(b, now=now)) is not None]
    if buckets:
        await conn.execute(
            queries.SAVE_TENANT_BUCKETS,
            {
                "tenant_ids": [b.tenant_id for b in buckets],
                "tokens": [b.tokens for b in buckets],
                "tokens_at": [b.tokens_at for b in buckets],
            },
        )
    return min(openings, default=None)


def earliest_opening(gates: Gates, *, now: dt.datetime, config: HealthConfig) -> dt.datetime | None:
    """`close_gates`' answer for a claim that took nothing, without writing anything."""
    openings = [
        opening
        for health in gates.locked.values()
        if (
            opening := next_opening(
                after_claim(health, 0, now=now, config=config), now=now, config=config
            )
        )
        is not None
    ]
    openings += [
        at
        for cap in gates.tenants_locked.values()
        if (at := tenant_next_opening(cap, now=now)) is not None
    ]
    return min(openings, default=None)


def next_opening(health: Health, *, now: dt.datetime, config: HealthConfig) -> dt.datetime | None:
    """When an endpoint that may take nothing right now may take one again, if time alone
    decides it (None: it is not gated now, or an outcome must arrive first: a probe's answer,
    a slot under its in-flight limit)."""
    if health.paused_until is not None and now < health.paused_until:
        return health.paused_until
    if health.breaker_state == OPEN:
        if health.open_until is not None and now < health.open_until:
            return health.open_until
        return None
    if health.breaker_state == HALF_OPEN:
        return None
    rate = effective_rate(health, now, config)
    if rate is None or rate <= 0:
        return None
    tokens = available_tokens(health, now, rate)
    if tokens >= 1:
        return None
    return now + dt.timedelta(seconds=(1 - tokens) / rate)


async def save(conn: AsyncConnection, rows: Sequence[Health], *, now: dt.datetime) -> None:
    if not rows:
        return
    params: dict[str, Any] = {name: [getattr(r, name) for r in rows] for name in STATE_FIELDS}
    params["now"] = now
    await conn.execute(queries.SAVE_ENDPOINT_HEALTH, params)


async def record_observations(
    conn: AsyncConnection,
    observations: Sequence[Observation],
    *,
    now: dt.datetime,
    config: HealthConfig,
    names: Mapping[int, str] | None = None,
) -> list[int]:
    """Update breakers from a batch of outcomes, in the outcomes' transaction.

    Returns the ids of endpoints disabled because they failed for too long. Call
    `ensure_health_rows` first (outside this transaction) so every row exists: the
    rows are then locked in id order, which keeps concurrent writers deadlock-free.
    A breaker that opens or closes, and an endpoint disabled, each log one line
    (`names` maps endpoint ids to the uids operators know).
    """
    summaries = summarize(observations, config)
    if not summaries:
        return []
    ids = sorted(summaries)
    current = await _lock_for_update(conn, ids)
    updated: list[Health] = []
    disabled: list[int] = []
    for endpoint_id in ids:
        health = current.get(endpoint_id, Health(endpoint_id))
        after = after_outcomes(health, summaries[endpoint_id], now=now, config=config)
        reason = (
            disable_reason(after, now=now, config=config)
            if summaries[endpoint_id].failures
            else None
        )
        if reason is not None:
            disabled_row = await conn.execute(
                queries.AUTO_DISABLE_ENDPOINT,
                {"id": endpoint_id, "reason": reason, "now": now},
            )
            uid = disabled_row.scalar_one_or_none()
            if uid is not None:
                disabled.append(endpoint_id)
                await conn.run_sync(_audit_disable, uid, reason)
                log.warning("endpoint %s disabled: %s", uid, reason)
            after = Health(endpoint_id, after.max_in_flight, after.max_per_second)
        else:
            log_transition(health, after, (names or {}).get(endpoint_id), now=now)
        if after != health:
            updated.append(after)
    await save(conn, updated, now=now)
    return disabled


def log_transition(before: Health, after: Health, uid: str | None, *, now: dt.datetime) -> None:
    """One line when a breaker opens (with why and for how long) and one when it closes."""
    name = uid or f"#{before.endpoint_id}"
    if after.breaker_state == OPEN and after.trips > before.trips:
        reopened = " again (the probe failed)" if before.breaker_state == HALF_OPEN else ""
        probe_in = (after.open_until - now).total_seconds() if after.open_until else 0.0
        log.warning(
            "circuit breaker of endpoint %s opened%s (%d consecutive failures, trip %d); "
            "last error: %s; its deliveries wait, next probe in %.0fs",
            name,
            reopened,
            after.consecutive_failures,
            after.trips,
            after.last_failure or "unknown",
            probe_in,
        )
    elif before.breaker_state != CLOSED and after.breaker_state == CLOSED:
        log.warning(
            "circuit breaker of endpoint %s closed: the probe succeeded; its backlog ramps back up",
            name,
        )


async def ensure_health_rows(
    engine: AsyncEngine, endpoint_ids: Iterable[int], known: set[int]
) -> None:
    """Create missing endpoint_health rows in a transaction of their own.

    `known` caches the ids this process has already seen, so this is a no-op on the hot
    path. Inserting in id order in one short statement cannot deadlock with anyone.
    """
    missing = sorted(set(endpoint_ids) - known)
    if not missing:
        return
    async with engine.begin() as conn:
        await conn.execute(queries.INSERT_MISSING_ENDPOINT_HEALTH, {"ids": missing})
    known.update(missing)


def _audit_disable(conn: Connection, uid: str, reason: str) -> None:
    record_audit(
        conn,
        actor="system:breaker",
        action="endpoint.auto_disable",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
    )


async def _lock_for_update(conn: AsyncConnection, ids: Sequence[int]) -> dict[int, Health]:
    rows = await conn.execute(queries.LOCK_ENDPOINT_HEALTH, {"ids": list(ids)})
    return {row.endpoint_id: Health.from_row(row) for row in rows}


def claimed_per_endpoint(endpoint_ids: Iterable[int]) -> dict[int, int]:
    return dict(Counter(endpoint_ids))


# -- operator settings ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    max_in_flight: int | None = None
    max_per_second: float | None = None
    ordered: bool = False
    dead_head: str = "block"

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def get_endpoint_limits(conn: Connection, uid: str, *, scope: str | None = None) -> EndpointLimits:
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    row = conn.execute(queries.SELECT_ENDPOINT_LIMITS, {"uid": uid}).first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    return EndpointLimits(row.max_in_flight, row.max_per_second, row.ordered, row.dead_head)


def set_endpoint_limits(
    conn: Connection, uid: str, limits: EndpointLimits, *, actor: str, scope: str | None = None
) -> EndpointLimits:
    """Set an endpoint's limits and ordering (replacing the previous ones), with an audit row."""
    if scope is not None:
        get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    if limits.max_in_flight is not None and limits.max_in_flight <= 0:
        raise EndpointError("max in flight must be a positive number, or unset for no limit")
    if limits.max_per_second is not None and limits.max_per_second <= 0:
        raise EndpointError("max per second must be a positive number, or unset for no limit")
    if limits.dead_head not in ("block", "skip"):
        raise EndpointError("dead head behaviour must be 'block' or 'skip'")
    row = conn.execute(
        queries.SET_ENDPOINT_LIMITS, {"uid": uid, **dataclasses.asdict(limits)}
    ).first()
    if row is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    record_audit(
        conn,
        actor=actor,
        action="endpoint.limits",
        target_type="endpoint",
        target_id=uid,
        details=limits.as_json(),
    )
    return limits


def endpoint_health_report(conn: Connection) -> list[dict[str, Any]]:
    """Every endpoint's limits and breaker state, for operators (`outbox endpoints health`)."""
    report = []
    for row in conn.execute(queries.SELECT_ENDPOINT_HEALTH).mappings():
        item = {
            key: value.isoformat() if isinstance(value, dt.datetime) else value
            for key, value in row.items()
        }
        report.append(item)
    return report
