"""Relay rate with payload filters (issue 25): 1,000 filtered endpoints against 1,000
unfiltered ones, in one run, on one database.

Two event types, each routed to 1,000 endpoints of its own: `plain.*` endpoints have no
filter, `filtered.*` endpoints carry `$.amount >= 100 && $.currency == "EUR"`, which
every published payload matches, so both fan out the same number of delivery rows and
the difference is the filter's evaluation alone. Rounds alternate (plain, filtered,
plain, ...) so background noise hits both alike; each round relays its events to the
end and is timed. `python -m bench.filters [--quick]` runs it alone; the harness runs it
as its `filters` section.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from sqlalchemy import create_engine, text

from outbox.clock import SystemClock
from outbox.db import make_async_engine, sqlalchemy_url
from outbox.relay import Relay, RelayConfig

FILTER = '$.amount >= 100 && $.currency == "EUR"'
PAYLOAD = {"order_id": 42, "amount": 150, "currency": "EUR", "note": "bench"}


@dataclass(frozen=True, slots=True)
class FilterPlan:
    endpoints: int = 1000  # of each kind
    events_per_round: int = 100  # each fans out to `endpoints` deliveries
    rounds: int = 3
    batch_size: int = 20  # events per relay pass (20,000 delivery rows at 1,000 endpoints)

    @classmethod
    def quick(cls) -> FilterPlan:
        return cls(endpoints=20, events_per_round=20, rounds=2)


def _setup(url: str, plan: FilterPlan) -> None:
    """Both kinds of endpoints, inserted in bulk (the subscriptions trigger indexes them)."""
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret,
                                       payload_filter)
                SELECT 'ep_bench_' || kind || '_' || g,
                       (SELECT id FROM tenants WHERE uid = 'default'),
                       'http://127.0.0.1:9/unused', ARRAY[kind || '.*'], 'unused',
                       CASE WHEN kind = 'filtered' THEN CAST(:filter AS text) END
                FROM generate_series(1, :count) AS g,
                     unnest(ARRAY['plain', 'filtered']) AS kind
                """
            ),
            {"count": plan.endpoints, "filter": FILTER},
        )
    engine.dispose()


def _publish(url: str, kind: str, count: int, round_: int) -> None:
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_bench_' || :kind || '_' || :round || '_' || g,
                       (SELECT id FROM tenants WHERE uid = 'default'),
                       :kind || '.created', CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {"kind": kind, "round": round_, "count": count, "payload": json.dumps(PAYLOAD)},
        )
    engine.dispose()


async def filter_rates(url: str, plan: FilterPlan) -> dict[str, Any]:
    """Relay rates (events/s and delivery rows/s) of unfiltered and filtered endpoints."""
    _setup(url, plan)
    engine = make_async_engine(url, pool_pre_ping=False)
    relay = Relay(engine, SystemClock(), RelayConfig(batch_size=plan.batch_size))
    seconds: dict[str, list[float]] = {"plain": [], "filtered": []}
    rows: dict[str, int] = {"plain": 0, "filtered": 0}
    try:
        for round_ in range(plan.rounds):
            for kind in ("plain", "filtered"):
                _publish(url, kind, plan.events_per_round, round_)
                began = time.perf_counter()
                done = await relay.run_until_idle()
                seconds[kind].append(time.perf_counter() - began)
                assert done.events == plan.events_per_round, done
                assert done.deliveries == plan.events_per_round * plan.endpoints, done
                rows[kind] += done.deliveries
    finally:
        await engine.dispose()
    result: dict[str, Any] = {
        "endpoints": plan.endpoints,
        "events_per_round": plan.events_per_round,
        "rounds": plan.rounds,
        "batch_size": plan.batch_size,
        "filter": FILTER,
    }
    for kind in ("plain", "filtered"):
        median = statistics.median(seconds[kind])
        result[kind] = {
            "round_seconds": [round(s, 3) for s in seconds[kind]],
            "events_per_s": round(plan.events_per_round / median, 1),
            "delivery_rows_per_s": round(plan.events_per_round * plan.endpoints / median),
        }
    result["filtered_vs_plain"] = round(
        result["filtered"]["delivery_rows_per_s"] / result["plain"]["delivery_rows_per_s"], 3
    )
    return result


def report(result: dict[str, Any]) -> str:
    """The bench row: both rates side by side."""
    plain, filtered = result["plain"], result["filtered"]
    return (
        f"relay with payload filters ({result['endpoints']} endpoints each, "
        f"{result['rounds']} rounds of {result['events_per_round']} events):\n"
        f"  unfiltered: {plain['events_per_s']} events/s, "
        f"{plain['delivery_rows_per_s']} delivery rows/s\n"
        f"  filtered:   {filtered['events_per_s']} events/s, "
        f"{filtered['delivery_rows_per_s']} delivery rows/s "
        f"({result['filtered_vs_plain']:.2f} of unfiltered)"
    )


@click.command()
@click.option("--quick", is_flag=True, help="20 endpoints of each kind, 2 rounds.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
def main(quick: bool, out: Path | None) -> None:
    """Run the filter rows alone on an embedded PostgreSQL of their own."""
    from outbox.db import make_engine
    from outbox.embedded import EmbeddedPostgres
    from outbox.migrate import upgrade

    plan = FilterPlan.quick() if quick else FilterPlan()
    with tempfile.TemporaryDirectory(prefix="bench-filters-") as root:
        server = EmbeddedPostgres(Path(root), delete_on_stop=True)
        url = server.start()
        try:
            engine = make_engine(url)
            upgrade(engine)
            engine.dispose()
            result = asyncio.run(filter_rates(url, plan))
        finally:
            server.stop()
    click.echo(report(result))
    if out is not None:
        out.write_text(json.dumps({"filters": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
