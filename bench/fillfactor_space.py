"""What lower fillfactors would cost in disk: the heap that kept history takes.

`python -m bench.fillfactor_space [ROUNDS] [EVENTS]`: on one server, a database as
migrated (fillfactor 100, the default) and one with `deliveries` at 40 and
`outbox_events` at 50 (docs/scaling.md, "HOT updates and fillfactor"), each through
ROUNDS rounds of: publish EVENTS
events (one endpoint), the relay's pass, every delivery claimed and recorded as succeeded
(the claim's and outcome's updates in their statements' shape, 100 rows a transaction),
VACUUM. Prints the heap of `deliveries` and `outbox_events` after each round: what a
kept history (until retention prunes it) occupies in each.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import psycopg

from bench.cluster import Cluster
from bench.components import _preload_events
from outbox.clock import SystemClock
from outbox.db import libpq_url, make_async_engine
from outbox.relay import Relay, RelayConfig

_EVENTS = """
    INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
    SELECT %s || g, (SELECT id FROM tenants WHERE uid = 'default'), 'order.created',
           '{"order_id": 123456, "customer": "cus_8f2a", "total_cents": 4999}'::jsonb
    FROM generate_series(1, %s) AS g
"""
_CLAIM = """
    UPDATE deliveries SET state = 'in_flight', locked_by = 'bench-host-12345-ab12cd34',
        lease_expires_at = now() + interval '60 s', updated_at = now(), claims = claims + 1
    WHERE id IN (SELECT id FROM deliveries WHERE state = 'scheduled' ORDER BY id LIMIT 100)
    RETURNING id
"""
_SUCCEEDED = """
    UPDATE deliveries SET state = 'succeeded', attempts = attempts + 1, locked_by = NULL,
        lease_expires_at = NULL, last_status_code = 200, updated_at = now(), completed_at = now()
    WHERE id = ANY(%s)
"""
_SIZES = """
    SELECT pg_relation_size('deliveries'), pg_relation_size('outbox_events'),
           (SELECT count(*) FROM deliveries)
"""


async def _relay(url: str) -> None:
    engine = make_async_engine(url)
    await Relay(engine, SystemClock(), RelayConfig(batch_size=2000)).run_until_idle()
    await engine.dispose()


def _round(url: str, number: int, events: int) -> tuple[int, int, int]:
    if number == 0:
        _preload_events(url, events, 1, "http://127.0.0.1:9/unused")
    else:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute(_EVENTS, (f"msg_round{number}_", events))
    asyncio.run(_relay(url))
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        while True:
            with conn.transaction():
                ids = [row[0] for row in conn.execute(_CLAIM).fetchall()]
            if not ids:
                break
            with conn.transaction():
                conn.execute(_SUCCEEDED, (ids,))
        conn.execute("VACUUM deliveries")
        conn.execute("VACUUM outbox_events")
        row = conn.execute(_SIZES).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def main(rounds: int = 4, events: int = 20_000) -> None:
    with tempfile.TemporaryDirectory(prefix="outbox-space-") as root:
        cluster = Cluster(Path(root))
        cluster.start()
        try:
            for variant in ("fillfactor 100 (as migrated)", "fillfactor 40 / 50"):
                url = cluster.database_url(cluster.new_database("space"))
                if variant.endswith("40 / 50"):
                    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
                        conn.execute("ALTER TABLE deliveries SET (fillfactor = 40)")
                        conn.execute("ALTER TABLE outbox_events SET (fillfactor = 50)")
                for number in range(rounds):
                    deliveries, events_heap, kept = _round(url, number, events)
                    print(
                        f"{variant}, round {number + 1}: {kept} deliveries kept, heap of "
                        f"deliveries {deliveries / 1e6:.1f} MB, of outbox_events "
                        f"{events_heap / 1e6:.1f} MB",
                        flush=True,
                    )
        finally:
            cluster.stop()


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
