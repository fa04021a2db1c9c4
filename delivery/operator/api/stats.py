"""Numbers: the stats an operator reads and the Prometheus metrics a scraper reads."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection
from starlette.responses import Response

from delivery.operator.api.core import Call, Operation
from delivery.operator.metrics import render_metrics
from delivery.operator.validation import NoInput, StatsQuery
from outbox import tenants as tenant_ops
from outbox.schema import LATENCY_BUCKETS
from outbox.stats import collect_stats, read_totals


async def stats_route(call: Call) -> Any:
    seconds = call.query_as(StatsQuery).window
    window = dt.timedelta(seconds=seconds) if seconds else call.api.config.stats_window
    now, tenant = call.api.clock.now(), await call.tenant()
    thresholds = call.api.config.thresholds
    stats = await call.api.read(
        lambda c: collect_stats(c, now=now, window=window, thresholds=thresholds, scope=tenant)
    )
    return {"tenant": tenant, **stats.as_json()}


async def metrics_route(call: Call) -> Any:
    """Every figure for the installation, or one tenant's (a scoped token, or ?tenant=).

    No series gets a tenant label: with thousands of tenants that would multiply the
    series count by the tenant count. Per-tenant numbers are a scrape per tenant (a
    scoped token, or `?tenant=`); the tenant count by state is the one tenant gauge.
    """
    now, tenant = call.api.clock.now(), await call.tenant()
    config = call.api.config

    def read(conn: Connection) -> bytes:
        stats = collect_stats(
            conn, now=now, window=config.stats_window, thresholds=config.thresholds, scope=tenant
        )
        totals = read_totals(conn, LATENCY_BUCKETS, scope=tenant)
        counts = None if tenant is not None else tenant_ops.count_tenants(conn)
        return render_metrics(totals, stats, tenants=counts)

    body = await call.api.read(read)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


routes = [
    Operation(
        "GET",
        "/metrics",
        "viewer",
        "Prometheus metrics (one tenant's with a scoped token or ?tenant=).",
        metrics_route,
        query=NoInput,
        tenant_filter=True,
    ),
    Operation(
        "GET",
        "/v1/stats",
        "viewer",
        "Backlog, lag, rates, per-endpoint health, top errors and alert signals.",
        stats_route,
        query=StatsQuery,
        tenant_filter=True,
    ),
]
