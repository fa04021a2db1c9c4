"""`outbox demo`: watch webhooks being delivered, retried and signed, in under 30 seconds.

Everything is local and temporary: an embedded PostgreSQL in a throw-away data
directory and a receiver on 127.0.0.1 playing one healthy and one failing partner.
"""

from __future__ import annotations

import asyncio
import hmac
import tempfile
from pathlib import Path

import click
from sqlalchemy import text

from delivery.operator import app
from delivery.reaper import ReaperConfig
from delivery.receiver import Receiver
from delivery.signing import sign
from outbox.crypto import SecretBox, generate_key, secret_key_bytes
from outbox.db import make_engine
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import create_endpoint
from outbox.migrate import upgrade
from outbox.publish import publish
from outbox.settings import Settings

DEMO_SECONDS = 8.0

_SUMMARY = text(
    """
    SELECT e.url, d.state, count(*) AS deliveries, sum(d.attempts) AS attempts,
           max(d.last_error) AS last_error, min(d.next_attempt_at) AS next_attempt_at
    FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id
    GROUP BY e.url, d.state ORDER BY e.url, d.state
    """
)

_BREAKERS = text(
    """
    SELECT e.url, h.breaker_state, h.consecutive_failures
    FROM endpoints e JOIN endpoint_health h ON h.endpoint_id = e.id
    WHERE h.breaker_state <> 'closed'
    ORDER BY e.url
    """
)


async def run_demo(settings: Settings) -> int:
    with tempfile.TemporaryDirectory(prefix="outbox-demo-") as tmp:
        click.echo("1. starting an embedded PostgreSQL (no server to install) ...")
        with EmbeddedPostgres(Path(tmp), delete_on_stop=True) as server:
            return await _tour(settings, server.url())


async def _tour(settings: Settings, url: str) -> int:
    engine = make_engine(url)
    upgrade(engine)
    box = SecretBox.from_setting(generate_key("demo"))
    async with Receiver() as receiver:
        healthy = receiver.route("/healthy", status=200)
        failing = receiver.route("/failing", status=500, body=b"upstream database is down")
        click.echo(f"2. a receiver on {receiver.base_url} plays two partners:")
        with engine.begin() as conn:
            good = create_endpoint(conn, box, url=healthy, event_types="order.*,invoice.paid")
            bad = create_endpoint(conn, box, url=failing, event_types="*")
        click.echo(f"   {good.endpoint.uid}  {healthy}  (answers 200, wants order.*, invoice.paid)")
        click.echo(f"   {bad.endpoint.uid}  {failing}  (answers 500, wants everything)")

        click.echo("3. publishing events inside application transactions ...")
        with engine.begin() as conn:
            for order_id in (1001, 1002, 1003):
                publish(conn, "order.created", {"order_id": order_id, "total_cents": 4200})
            publish(conn, "invoice.paid", {"invoice_id": "inv_7"}, idempotency_key="inv_7-paid")
            publish(conn, "invoice.paid", {"invoice_id": "inv_7"}, idempotency_key="inv_7-paid")
            publish(conn, "customer.updated", {"customer_id": "cus_9"})
        with engine.connect() as conn, conn.begin() as transaction:
            publish(conn, "order.created", {"order_id": 9999, "note": "rolled back"})
            transaction.rollback()
        click.echo("   5 events committed (a duplicate idempotency key was folded into one),")
        click.echo("   1 event rolled back with its transaction: it will never be sent.")

        click.echo(f"4. running relay + workers for {DEMO_SECONDS:g}s (retry schedule 1s, 2s) ...")
        service = app.Service(
            url,
            box,
            relay=app.relay_config(settings).__class__(batch_size=100, poll_interval=0.2),
            worker=app.worker_config(settings).__class__(
                poll_interval=0.2, retry_schedule=(1.0, 2.0), request_timeout=5.0
            ),
            reaper=ReaperConfig(interval=1.0),
            # The demo's partners live on loopback, which the SSRF guard refuses by default.
            allowed_networks=("127.0.0.0/8",),
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(service.run(stop))
        await asyncio.wait([runner], timeout=DEMO_SECONDS)
        stop.set()
        await runner

        _print_summary(engine, receiver, healthy, failing, good.secret)
    engine.dispose()
    return 0


def _print_summary(
    engine: object, receiver: Receiver, healthy: str, failing: str, secret: str
) -> None:
    from sqlalchemy import Engine

    assert isinstance(engine, Engine)
    with engine.connect() as conn:
        rows = conn.execute(_SUMMARY).all()
        breakers = conn.execute(_BREAKERS).all()
    click.echo("\nWhat happened")
    click.echo(f"  {'endpoint':<34} {'state':<10} {'deliveries':>10} {'attempts':>8}  detail")
    for row in rows:
        detail = ""
        if row.state == "scheduled":
            detail = f"retrying: {row.last_error}"
        elif row.state == "dead":
            detail = f"dead: {row.last_error}"
        click.echo(
            f"  {row.url:<34} {row.state:<10} {row.deliveries:>10} {row.attempts:>8}  {detail}"
        )
    arrived = receiver.received("/healthy")
    failed_tries = receiver.received("/failing")
    click.echo(
        f"\n  the healthy partner received {len(arrived)} requests; "
        f"the failing one was tried {len(failed_tries)} times so far."
    )
    for breaker in breakers:
        click.echo(
            f"  {breaker.url}: circuit breaker {breaker.breaker_state} after repeated "
            "failures, so it gets one probe per cooldown instead of every retry at once."
        )
    if arrived:
        first = arrived[0]
        expected = sign(
            secret_key_bytes(secret),
            first.headers["webhook-id"],
            int(first.headers["webhook-timestamp"]),
            first.body,
        )
        valid = any(
            hmac.compare_digest(expected, candidate)
            for candidate in first.headers["webhook-signature"].split(" ")
        )
        click.echo("\nOne request as the partner saw it")
        for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
            click.echo(f"  {name}: {first.headers[name]}")
        click.echo(f"  body: {first.body.decode()}")
        click.echo(f"  signature verifies with the endpoint secret: {'yes' if valid else 'NO'}")
    click.echo(
        "\nNext steps (on your own database; this tour's is gone)\n"
        "  outbox endpoints add https://example.com/hooks --events 'order.*'\n"
        "  outbox publish order.created '{\"order_id\": 1}'\n"
        "  outbox run                     # relay + workers until Ctrl-C\n"
        "  outbox endpoints list --json\n"
        "  outbox stats\n"
        "  outbox deliveries list --state dead\n"
        "  outbox replay --state dead --reason 'partner fixed' --dry-run   # then without it\n"
        "  In code: from outbox import publish; publish(conn, 'order.created', {...})"
    )
