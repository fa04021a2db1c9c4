"""Numbers an operator (or an alert rule) needs: backlog, lag, rates, per-endpoint health.

Per-endpoint health includes the circuit breaker as the workers left it in
`endpoint_health` (delivery/health/ writes it; this module only reads the row,
so outbox/ still never imports delivery/).

Everything is read from the database, so every process and every replica report
the same figures, and they survive restarts. `now` is passed in (an injected
clock), which keeps windows and ages testable without sleeping.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sqlalchemy import Connection

from outbox.schema import ATTEMPT_OUTCOMES as OUTCOMES
from outbox.schema import BREAKER_STATES, DELIVERY_STATES
from outbox.sql import stats as queries
from outbox.sql import workflows as workflow_queries
from outbox.tenants import scope_params
from outbox.wording import plural
from outbox.workflows import Workflow, with_thresholds

TOP_ERRORS = 5
# Owners counted one by one (metric labels): the rest are summed under OTHER_OWNERS.
MAX_OWNERS = 50
UNOWNED = "(unowned)"  # not a valid owner name (outbox.owners), so never a clash
OTHER_OWNERS = "(other)"


@dataclass(frozen=True, slots=True)
class AlertThresholds:
    """When an alert signal fires. Defaults suit a small service; tune them in settings."""

    dead_per_window: int = 10
    repeated_error_deliveries: int = 20
    oldest_due_seconds: float = 900.0
    relay_lag_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class Breaker:
    """An endpoint's circuit breaker, as stored in its `endpoint_health` row.

    The columns are reported as they are (a missing row reads as a closed breaker
    with no history), so every view agrees with `outbox endpoints health`.
    `opened_at` is when it last opened and stays set after it closes; `open_until`
    is when the cooldown ends and the next probe may be claimed; `probe_until` is
    the lease of a probe in flight (half_open). `paused` is derived from
    `paused_until` and the snapshot's clock: a 429 asked the workers to wait.
    """

    state: str
    opened_at: dt.datetime | None
    open_until: dt.datetime | None
    probe_until: dt.datetime | None
    paused_until: dt.datetime | None
    consecutive_failures: int
    trips: int
    paused: bool
    cooldown_remaining_seconds: float | None
    # adaptive concurrency (None unless opted in): the limit now and its ceiling
    adaptive_limit: int | None = None
    adaptive_max: int | None = None

    @classmethod
    def from_row(cls, row: Any, now: dt.datetime) -> Breaker:
        paused_until, open_until = row["paused_until"], row["open_until"]
        return cls(
            state=str(row["breaker_state"]),
            opened_at=row["opened_at"],
            open_until=open_until,
            probe_until=row["probe_until"],
            paused_until=paused_until,
            consecutive_failures=int(row["consecutive_failures"]),
            trips=int(row["trips"]),
            paused=paused_until is not None and now < paused_until,
            cooldown_remaining_seconds=(
                max((open_until - now).total_seconds(), 0.0)
                if row["breaker_state"] == "open" and open_until is not None
                else None
            ),
            adaptive_limit=row.get("adaptive_limit"),
            adaptive_max=row.get("adaptive_max"),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            key: value.isoformat() if isinstance(value, dt.datetime) else value
            for key, value in asdict(self).items()
        }


@dataclass(frozen=True, slots=True)
class EndpointHealth:
    uid: str
    tenant: str
    all_tenants: bool
    url: str
    enabled: bool
    disabled_reason: str | None
    auto_disabled: bool
    attempts: int
    succeeded: int
    p50_ms: float | None
    p99_ms: float | None
    pending: int
    dead: int
    breaker: Breaker

    @property
    def success_rate(self) -> float | None:
        return self.succeeded / self.attempts if self.attempts else None

    @property
    def error_rate(self) -> float | None:
        return 1 - self.succeeded / self.attempts if self.attempts else None

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "breaker": self.breaker.as_json(),
            "success_rate": self.success_rate,
            "error_rate": self.error_rate,
        }


@dataclass(frozen=True, slots=True)
class ErrorCount:
    error: str
    deliveries: int
    attempts: int
    endpoints: int
    last_seen: dt.datetime

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "last_seen": self.last_seen.isoformat()}


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    firing: bool
    value: float
    threshold: float
    message: str


@dataclass(frozen=True, slots=True)
class WorkflowHealth:
    """One event type's measures against its own thresholds (outbox.workflows)."""

    event_type: str
    owner: str | None
    oldest_due_age_seconds: float | None
    attempts: int
    error_rate: float | None
    processing_p95_seconds: float | None
    thresholds: Workflow

    @property
    def late(self) -> list[str]:
        """Which of its thresholds are crossed: 'oldest', 'error_rate', 'processing_p95'."""
        t = self.thresholds
        crossed = []
        if t.alert_oldest_seconds is not None and (self.oldest_due_age_seconds or 0.0) >= (
            t.alert_oldest_seconds
        ):
            crossed.append("oldest")
        if t.alert_error_rate is not None and (self.error_rate or 0.0) >= t.alert_error_rate:
            crossed.append("error_rate")
        if t.alert_processing_p95_seconds is not None and (self.processing_p95_seconds or 0.0) >= (
            t.alert_processing_p95_seconds
        ):
            crossed.append("processing_p95")
        return crossed

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["thresholds"] = self.thresholds.as_json()
        data["late"] = self.late
        return data


@dataclass(frozen=True, slots=True)
class Stats:
    at: dt.datetime
    window_seconds: float
    counts_by_state: dict[str, int]
    due_now: int
    oldest_due_age_seconds: float | None
    unrelayed_events: int
    relay_lag_seconds: float | None
    window: dict[str, int]
    per_minute: dict[str, float]
    endpoints: list[EndpointHealth] = field(default_factory=list)
    top_errors: list[ErrorCount] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    dead_by_owner: dict[str, int] = field(default_factory=dict)
    held_by_owner: dict[str, int] = field(default_factory=dict)
    workflows: list[WorkflowHealth] = field(default_factory=list)

    @property
    def breaker_counts(self) -> dict[str, int]:
        """How many endpoints' breakers are in each state (every state listed, 0 included)."""
        counts = dict.fromkeys(BREAKER_STATES, 0)
        for endpoint in self.endpoints:
            counts[endpoint.breaker.state] = counts.get(endpoint.breaker.state, 0) + 1
        return counts

    @property
    def firing(self) -> list[Alert]:
        return [alert for alert in self.alerts if alert.firing]

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "window_seconds": self.window_seconds,
            "counts_by_state": self.counts_by_state,
            "due_now": self.due_now,
            "oldest_due_age_seconds": self.oldest_due_age_seconds,
            "unrelayed_events": self.unrelayed_events,
            "relay_lag_seconds": self.relay_lag_seconds,
            "window": self.window,
            "per_minute": self.per_minute,
            "endpoints": [item.as_json() for item in self.endpoints],
            "breakers": self.breaker_counts,
            "top_errors": [item.as_json() for item in self.top_errors],
            "alerts": [asdict(alert) for alert in self.alerts],
            "dead_by_owner": self.dead_by_owner,
            "held_by_owner": self.held_by_owner,
            "workflows": [item.as_json() for item in self.workflows],
        }


def _age(now: dt.datetime, since: dt.datetime | None) -> float | None:
    return max((now - since).total_seconds(), 0.0) if since is not None else None


def collect_stats(
    conn: Connection,
    *,
    now: dt.datetime,
    window: dt.timedelta = dt.timedelta(hours=1),
    thresholds: AlertThresholds | None = None,
    scope: str | None = None,
) -> Stats:
    """One consistent-enough snapshot (a handful of cheap queries, no locks taken).

    With `scope` (a tenant uid) every figure is that tenant's alone: its deliveries (those
    of its endpoints) and their attempts, its endpoints, and the events it published.
    """
    limits = thresholds or AlertThresholds()
    since = now - window
    scoped = scope_params(conn, scope)
    counts = {state: 0 for state in DELIVERY_STATES}
    counts.update(
        {str(row.state): int(row.n) for row in conn.execute(queries.STATS_COUNTS_BY_STATE, scoped)}
    )
    due = conn.execute(queries.STATS_OLDEST_DUE, {"now": now, **scoped}).one()
    lag = conn.execute(queries.STATS_RELAY_LAG, scoped).one()
    rates = (
        conn.execute(
            queries.STATS_WINDOW_RATES,
            {"now": now, "since": since, "previous": since - window, **scoped},
        )
        .mappings()
        .one()
    )
    params = {"now": now, "since": since, **scoped}
    columns = [name for name in EndpointHealth.__dataclass_fields__ if name != "breaker"]
    endpoints = [
        EndpointHealth(**{name: row[name] for name in columns}, breaker=Breaker.from_row(row, now))
        for row in conn.execute(queries.STATS_ENDPOINTS, params).mappings()
    ]
    errors = [
        ErrorCount(**row)
        for row in conn.execute(
            queries.STATS_TOP_ERRORS, {**params, "limit": TOP_ERRORS}
        ).mappings()
    ]
    dead_by_owner, held_by_owner = _failures_by_owner(conn, scoped)
    minutes = window.total_seconds() / 60.0
    window_counts = {key: int(value) for key, value in rates.items()}
    stats = Stats(
        at=now,
        window_seconds=window.total_seconds(),
        counts_by_state=counts,
        due_now=int(due.due),
        oldest_due_age_seconds=_age(now, due.oldest_due),
        unrelayed_events=int(lag.unrelayed),
        relay_lag_seconds=_age(now, lag.oldest_unrelayed),
        window=window_counts,
        per_minute={
            key: round(window_counts[key] / minutes, 3)
            for key in ("published", "attempts", "succeeded", "dead")
        },
        endpoints=endpoints,
        top_errors=errors,
        dead_by_owner=dead_by_owner,
        held_by_owner=held_by_owner,
        workflows=_workflows(conn, now=now, since=since, scoped=scoped),
    )
    return replace(stats, alerts=evaluate_alerts(stats, limits))


def _failures_by_owner(
    conn: Connection, scoped: dict[str, Any]
) -> tuple[dict[str, int], dict[str, int]]:
    """Dead and held counts per owner; past MAX_OWNERS the rest are summed as (other)."""
    rows = conn.execute(queries.STATS_FAILURES_BY_OWNER, {"limit": MAX_OWNERS + 1, **scoped})
    dead: dict[str, int] = {}
    held: dict[str, int] = {}
    for index, row in enumerate(rows):
        owner = OTHER_OWNERS if index >= MAX_OWNERS else (row.owner or UNOWNED)
        for counts, value in ((dead, int(row.dead)), (held, int(row.held))):
            if value:
                counts[owner] = counts.get(owner, 0) + value
    return dead, held


def _workflows(
    conn: Connection, *, now: dt.datetime, since: dt.datetime, scoped: dict[str, Any]
) -> list[WorkflowHealth]:
    """The event types with thresholds (at most MAX_WORKFLOW_ALERTS), measured over the
    window with indexed queries (outbox/sql/workflows.py)."""
    configured = {item.name: item for item in with_thresholds(conn)}
    if not configured:
        return []
    measured = conn.execute(
        workflow_queries.WORKFLOW_MEASURES,
        {"types": list(configured), "now": now, "since": since, **scoped},
    )
    return [
        WorkflowHealth(
            event_type=row.event_type,
            owner=configured[row.event_type].owner,
            oldest_due_age_seconds=_age(now, row.oldest_due),
            attempts=int(row.attempts),
            error_rate=int(row.failed) / int(row.attempts) if row.attempts else None,
            processing_p95_seconds=(
                float(row.p95_seconds) if row.p95_seconds is not None else None
            ),
            thresholds=configured[row.event_type],
        )
        for row in measured
    ]


def evaluate_alerts(stats: Stats, limits: AlertThresholds) -> list[Alert]:
    """The alert signals, each with its value and threshold so a human can judge it."""
    dead = stats.window["dead"]
    top = stats.top_errors[0] if stats.top_errors else None
    oldest = stats.oldest_due_age_seconds or 0.0
    lag = stats.relay_lag_seconds or 0.0
    auto_disabled = [e.uid for e in stats.endpoints if e.auto_disabled]
    held = stats.counts_by_state.get("held", 0)
    # A half-open breaker is still an unhealthy endpoint (its probe is out): counting it
    # keeps the signal from flapping off for the length of every probe. A disabled
    # endpoint's breaker stays as it was (nothing probes it), and the disable has its own
    # signal, so it is left out rather than firing until someone re-enables it.
    broken = [e for e in stats.endpoints if e.enabled and e.breaker.state != "closed"]
    window = f"{stats.window_seconds / 60:g} min"
    previous = stats.window["dead_previous_window"]
    dead_firing = dead >= limits.dead_per_window
    top_firing = top is not None and top.deliveries >= limits.repeated_error_deliveries
    oldest_firing = oldest >= limits.oldest_due_seconds
    lag_firing = lag >= limits.relay_lag_seconds
    # Each message says what is wrong when the signal fires and what is fine when not.
    if dead_firing:
        dead_message = (
            f"{plural(dead, 'delivery', 'deliveries')} went dead in the last {window} "
            f"({previous} the window before); `outbox deliveries list --state dead` shows them"
        )
    elif dead:
        dead_message = (
            f"{plural(dead, 'delivery', 'deliveries')} went dead in the last {window}, "
            f"below the threshold of {limits.dead_per_window}"
        )
    else:
        dead_message = f"no delivery went dead in the last {window}"
    if stats.dead_by_owner:  # whose they are: every dead delivery now, by its owner
        dead_message += "; dead now by owner: " + _owner_counts(stats.dead_by_owner)
    if top is None:
        error_message = "no failed attempts in the window"
    else:
        error_message = (
            f"{top.error!r} hit {plural(top.deliveries, 'delivery', 'deliveries')} on "
            f"{plural(top.endpoints, 'endpoint')}"
            + ("" if top_firing else f", below the threshold of {limits.repeated_error_deliveries}")
        )
    if oldest_firing:
        oldest_message = (
            f"the oldest due delivery has waited {oldest:.0f}s: workers are behind or stopped"
        )
    elif stats.oldest_due_age_seconds is None:
        oldest_message = "no delivery is waiting: workers are keeping up"
    else:
        oldest_message = f"the oldest due delivery has waited {oldest:.0f}s: workers are keeping up"
    if lag_firing:
        lag_message = f"the oldest unrelayed event is {lag:.0f}s old: is the relay running?"
    elif stats.relay_lag_seconds is None or lag < 1:
        lag_message = "every event is relayed: the relay is keeping up"
    else:
        lag_message = f"the oldest unrelayed event is {lag:.0f}s old: the relay is keeping up"
    return [
        Alert("dead_letters_rising", dead_firing, dead, limits.dead_per_window, dead_message),
        Alert(
            "repeated_error",
            top_firing,
            top.deliveries if top else 0,
            limits.repeated_error_deliveries,
            error_message,
        ),
        Alert(
            "oldest_due_delivery",
            oldest_firing,
            oldest,
            limits.oldest_due_seconds,
            oldest_message,
        ),
        Alert(
            "endpoint_auto_disabled",
            bool(auto_disabled),
            len(auto_disabled),
            1,
            "auto-disabled: " + ", ".join(auto_disabled)
            if auto_disabled
            else "no endpoint was disabled automatically",
        ),
        Alert(
            "endpoint_breaker_open",
            bool(broken),
            len(broken),
            1,
            "breaker open: "
            + ", ".join(f"{e.uid} ({e.breaker.state.replace('_', '-')})" for e in broken)
            + "; `outbox endpoints health` shows why"
            if broken
            else "every enabled endpoint's breaker is closed",
        ),
        Alert("relay_lag", lag_firing, lag, limits.relay_lag_seconds, lag_message),
        Alert(
            "deliveries_held",
            held >= 1,
            held,
            1,
            f"{plural(held, 'delivery', 'deliveries')} held for review, by owner: "
            + _owner_counts(stats.held_by_owner)
            + "; `outbox deliveries list --state held` shows them"
            if held
            else "no delivery is held for review",
        ),
        *_workflow_alerts(stats.workflows),
    ]


def _owner_counts(counts: dict[str, int]) -> str:
    """`payments: 2, no owner: 1` for a person reading an alert (the labels UNOWNED and
    OTHER_OWNERS are for metrics and JSON, where a key must be a string)."""
    shown = {UNOWNED: "no owner", OTHER_OWNERS: "other owners"}
    return ", ".join(f"{shown.get(owner, owner)}: {n}" for owner, n in counts.items())


def _workflow_alerts(workflows: list[WorkflowHealth]) -> list[Alert]:
    """One signal per threshold an event type sets (`outbox event-types set`)."""
    alerts = []
    for item in workflows:
        t, owner = item.thresholds, f" (owner {item.owner})" if item.owner else " (no owner)"
        if t.alert_oldest_seconds is not None:
            oldest = item.oldest_due_age_seconds or 0.0
            alerts.append(
                Alert(
                    f"workflow_oldest_due:{item.event_type}",
                    "oldest" in item.late,
                    oldest,
                    t.alert_oldest_seconds,
                    f"{item.event_type}{owner}: the oldest due delivery has waited "
                    f"{oldest:.0f}s (threshold {t.alert_oldest_seconds:g}s)",
                )
            )
        if t.alert_error_rate is not None:
            rate = item.error_rate or 0.0
            alerts.append(
                Alert(
                    f"workflow_error_rate:{item.event_type}",
                    "error_rate" in item.late,
                    rate,
                    t.alert_error_rate,
                    f"{item.event_type}{owner}: {rate:.0%} of {item.attempts} attempts in the "
                    f"window failed (threshold {t.alert_error_rate:.0%})",
                )
            )
        if t.alert_processing_p95_seconds is not None:
            p95 = item.processing_p95_seconds or 0.0
            alerts.append(
                Alert(
                    f"workflow_processing_p95:{item.event_type}",
                    "processing_p95" in item.late,
                    p95,
                    t.alert_processing_p95_seconds,
                    f"{item.event_type}{owner}: p95 from publish to delivered is {p95:.1f}s "
                    f"(threshold {t.alert_processing_p95_seconds:g}s)",
                )
            )
    return alerts


@dataclass(frozen=True, slots=True)
class Totals:
    """Monotonic totals for /metrics: rows stored now plus rows retention has pruned."""

    events_published: int
    events_relayed: int
    attempts_by_outcome: dict[str, int]
    latency_buckets: list[tuple[float, int]]  # (upper bound in s, cumulative count)
    latency_count: int
    latency_sum_seconds: float


def read_totals(
    conn: Connection, buckets: tuple[float, ...], *, scope: str | None = None
) -> Totals:
    """Bucket bounds are seconds in whole milliseconds (0.05, 0.25, 1, ...).

    With `scope` (a tenant uid) the totals are that tenant's: its stored rows plus the
    tallies of its pruned ones, so a scoped total never drops either.
    """
    scoped = scope_params(conn, scope)
    pruned = {
        str(r.name): float(r.value) for r in conn.execute(queries.SELECT_PRUNED_TOTALS, scoped)
    }
    events = conn.execute(queries.METRICS_EVENTS, scoped).one()
    by_outcome = {outcome: int(pruned.get(f"attempts:{outcome}", 0)) for outcome in OUTCOMES}
    bounds = sorted(buckets)
    per_bucket = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf only)
    count = 0
    seconds = pruned.get("attempt_seconds_sum", 0.0)
    params = {
        "bounds_ms_plus_one": [round(bound * 1000) + 1 for bound in bounds],
        **scoped,
    }
    for row in conn.execute(queries.METRICS_ATTEMPTS, params):
        by_outcome[str(row.outcome)] = by_outcome.get(str(row.outcome), 0) + int(row.n)
        count += int(row.n)
        seconds += float(row.seconds)
        per_bucket[int(row.bucket)] += int(row.n)
    cumulative: list[tuple[float, int]] = []
    running = 0
    for index, bound in enumerate(bounds):
        running += per_bucket[index]
        # The tally keys are written by SQL, which prints 1.0 as "1": so does :g.
        cumulative.append((bound, running + int(pruned.get(f"attempt_seconds_le:{bound:g}", 0))))
    pruned_attempts = sum(int(v) for k, v in pruned.items() if k.startswith("attempts:"))
    return Totals(
        events_published=int(events.published) + int(pruned.get("events", 0)),
        events_relayed=int(events.relayed) + int(pruned.get("events", 0)),
        attempts_by_outcome=by_outcome,
        latency_buckets=cumulative,
        latency_count=count + pruned_attempts,
        latency_sum_seconds=seconds,
    )
