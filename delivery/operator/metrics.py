"""/metrics in the Prometheus text format, with every number read from the database.

Reading from the database (not from in-process counters) means every replica
reports the same truth and nothing resets on restart. Totals stay monotonic across
retention because pruned rows are tallied in `pruned_totals`. A fresh registry is
built per scrape, so there is no global state to leak between apps or tests.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from outbox.schema import BREAKER_STATES
from outbox.stats import Stats, Totals


class _Snapshot(Collector):
    def __init__(self, totals: Totals, stats: Stats, tenants: dict[str, int] | None) -> None:
        self._totals = totals
        self._stats = stats
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        totals, stats = self._totals, self._stats
        yield CounterMetricFamily(
            "outbox_events_published", "Events written to the outbox.", totals.events_published
        )
        yield CounterMetricFamily(
            "outbox_events_relayed",
            "Events fanned out into deliveries.",
            totals.events_relayed,
        )
        attempts = CounterMetricFamily(
            "outbox_delivery_attempts", "HTTP delivery attempts by outcome.", labels=["outcome"]
        )
        for outcome, count in sorted(totals.attempts_by_outcome.items()):
            attempts.add_metric([outcome], count)
        yield attempts
        yield HistogramMetricFamily(
            "outbox_delivery_attempt_duration_seconds",
            "Duration of delivery attempts (connect, send and capped body read).",
            buckets=[(f"{bound:g}", count) for bound, count in totals.latency_buckets]
            + [("+Inf", totals.latency_count)],
            sum_value=totals.latency_sum_seconds,
        )
        backlog = GaugeMetricFamily("outbox_deliveries", "Deliveries by state.", labels=["state"])
        for state, count in stats.counts_by_state.items():
            backlog.add_metric([state], count)
        yield backlog
        yield GaugeMetricFamily(
            "outbox_due_deliveries", "Deliveries due now on enabled endpoints.", stats.due_now
        )
        yield GaugeMetricFamily(
            "outbox_oldest_due_delivery_age_seconds",
            "How long the oldest due delivery has waited (0 when none is due).",
            stats.oldest_due_age_seconds or 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_unrelayed_events", "Events not yet relayed.", stats.unrelayed_events
        )
        yield GaugeMetricFamily(
            "outbox_relay_lag_seconds",
            "Age of the oldest unrelayed event (0 when none).",
            stats.relay_lag_seconds or 0.0,
        )
        enabled = GaugeMetricFamily(
            "outbox_endpoint_enabled", "1 if the endpoint is enabled.", labels=["endpoint"]
        )
        pending = GaugeMetricFamily(
            "outbox_endpoint_pending_deliveries",
            "Scheduled and in-flight deliveries per endpoint.",
            labels=["endpoint"],
        )
        success = GaugeMetricFamily(
            "outbox_endpoint_success_ratio",
            "Share of the stats window's attempts that succeeded (absent without attempts).",
            labels=["endpoint"],
        )
        # The usual Prometheus enum: one series per state, 1 for the current one, so
        # `outbox_endpoint_breaker_state{state="open"} == 1` selects the open breakers.
        breaker = GaugeMetricFamily(
            "outbox_endpoint_breaker_state",
            "Circuit breaker state per endpoint: 1 for the current state, 0 for the others.",
            labels=["endpoint", "state"],
        )
        paused = GaugeMetricFamily(
            "outbox_endpoint_paused",
            "1 while the endpoint is paused by a 429 (Retry-After or the default pause).",
            labels=["endpoint"],
        )
        concurrency = GaugeMetricFamily(
            "outbox_endpoint_concurrency_limit",
            "The adaptive in-flight limit of endpoints that opted in (absent for the others).",
            labels=["endpoint"],
        )
        for endpoint in stats.endpoints:
            if endpoint.breaker.adaptive_limit is not None:
                concurrency.add_metric([endpoint.uid], endpoint.breaker.adaptive_limit)
            enabled.add_metric([endpoint.uid], 1.0 if endpoint.enabled else 0.0)
            for state in BREAKER_STATES:
                current = 1.0 if endpoint.breaker.state == state else 0.0
                breaker.add_metric([endpoint.uid, state], current)
            paused.add_metric([endpoint.uid], 1.0 if endpoint.breaker.paused else 0.0)
            pending.add_metric([endpoint.uid], endpoint.pending)
            if endpoint.success_rate is not None:
                success.add_metric([endpoint.uid], endpoint.success_rate)
        yield enabled
        yield pending
        yield success
        yield breaker
        yield paused
        yield concurrency
        yield GaugeMetricFamily(
            "outbox_endpoint_breaker_open",
            "Endpoints whose circuit breaker is open (cooling down before the next probe).",
            stats.breaker_counts["open"],
        )
        # Label cardinality is bounded: at most outbox.stats.MAX_OWNERS owners (the rest
        # summed as "(other)") and outbox.workflows.MAX_WORKFLOW_ALERTS event types.
        owners = GaugeMetricFamily(
            "outbox_owner_deliveries",
            "Dead and held deliveries per owner (the endpoint's, else the event type's).",
            labels=["owner", "state"],
        )
        for state, counts in (("dead", stats.dead_by_owner), ("held", stats.held_by_owner)):
            for owner, count in counts.items():
                owners.add_metric([owner, state], count)
        yield owners
        oldest = GaugeMetricFamily(
            "outbox_event_type_oldest_due_age_seconds",
            "Per event type with alert thresholds: the oldest due delivery's wait (0 if none).",
            labels=["event_type"],
        )
        error_rate = GaugeMetricFamily(
            "outbox_event_type_error_rate",
            "Per event type with alert thresholds: failed share of the window's attempts.",
            labels=["event_type"],
        )
        p95 = GaugeMetricFamily(
            "outbox_event_type_processing_p95_seconds",
            "Per event type with alert thresholds: p95 from publish to delivered, in the window.",
            labels=["event_type"],
        )
        for flow in stats.workflows:
            oldest.add_metric([flow.event_type], flow.oldest_due_age_seconds or 0.0)
            if flow.error_rate is not None:
                error_rate.add_metric([flow.event_type], flow.error_rate)
            if flow.processing_p95_seconds is not None:
                p95.add_metric([flow.event_type], flow.processing_p95_seconds)
        yield oldest
        yield error_rate
        yield p95
        alerts = GaugeMetricFamily(
            "outbox_alert_firing", "1 while an alert signal fires.", labels=["alert"]
        )
        values = GaugeMetricFamily(
            "outbox_alert_value", "The value each alert signal compares.", labels=["alert"]
        )
        for alert in stats.alerts:
            alerts.add_metric([alert.name], 1.0 if alert.firing else 0.0)
            values.add_metric([alert.name], alert.value)
        yield alerts
        yield values
        if self._tenants is not None:
            tenants = GaugeMetricFamily(
                "outbox_tenants", "Tenants by state (enabled, disabled).", labels=["state"]
            )
            for state, count in self._tenants.items():
                tenants.add_metric([state], count)
            yield tenants


def render_metrics(totals: Totals, stats: Stats, *, tenants: dict[str, int] | None = None) -> bytes:
    """`tenants` (counts by state) only for an unscoped scrape: a tenant sees its own figures.

    No series carries a tenant label (the cardinality would grow with the customer
    count); one tenant's figures are a scrape scoped to it (a scoped token, ?tenant=).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(totals, stats, tenants))
    return generate_latest(registry)
