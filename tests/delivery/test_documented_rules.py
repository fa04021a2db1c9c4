"""Documented rules that a wrong line used to break without any test noticing (issue 15).

Each test pins the exact documented outcome: Retry-After only on 429 and 503, the old
signing secret stops signing when its grace ends, and the most specific per-event-type
rule wins for every setting that can be overridden per event type.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from delivery.http import build_http_client
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoints import rotate_secret
from outbox.relay import Relay, RelayConfig
from tests.helpers import LOOPBACK, WIRE_ONLY, add_endpoint, rows

# Each rule here is decided after the response, the same on either transport.
pytestmark = WIRE_ONLY


@pytest.fixture
async def http(transport: str) -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(
        max_connections=10, timeout=5, allowed_networks=LOOPBACK, transport=transport
    ) as client:
        yield client


def publish_one(engine: Engine, event_type: str = "order.created") -> None:
    with engine.begin() as conn:
        publish(conn, event_type, {"id": 1})


def delays(engine: Engine, clock: ManualClock) -> dict[str, tuple[int, float]]:
    """Per event type: the delivery's max attempts and its delay until the next attempt."""
    return {
        r["event_type"]: (r["max_attempts"], r["delay"])
        for r in rows(
            engine,
            "SELECT ev.event_type, d.max_attempts,"
            " extract(epoch FROM d.next_attempt_at - :now)::float AS delay"
            " FROM deliveries d JOIN outbox_events ev ON ev.id = d.event_id",
            now=clock.now(),
        )
    }


@pytest.mark.parametrize("status", [500, 502, 408])
async def test_retry_after_is_ignored_on_statuses_other_than_429_and_503(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
    status: int,
) -> None:
    url = receiver.route("/busy", status=status, headers={"Retry-After": "3600"})
    add_endpoint(engine, box, url)
    publish_one(engine)
    await Relay(async_engine, clock).run_until_idle()
    config = WorkerConfig(retry_schedule=(10.0,))
    assert (await Worker(async_engine, http, box, clock, config).run_once()).scheduled == 1
    [(_, delay)] = delays(engine, clock).values()
    assert 8.0 <= delay <= 12.0  # the normal schedule (10 s +-20%), not the hour asked for


async def test_the_old_secret_stops_signing_when_the_grace_ends(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
) -> None:
    created = add_endpoint(engine, box, receiver.route("/hook"))
    uid = created.endpoint.uid
    with engine.begin() as conn:
        rotated = rotate_secret(
            conn, box, uid, actor="test", now=clock.now(), grace=dt.timedelta(seconds=60)
        )
    old, new = Webhook(created.secret), Webhook(rotated.secret)
    worker = Worker(async_engine, http, box, clock, WorkerConfig())
    relay = Relay(async_engine, clock)

    clock.advance(59)  # inside the grace: both secrets sign
    publish_one(engine)
    await relay.run_until_idle()
    assert (await worker.run_once()).succeeded == 1
    clock.advance(1)  # the grace ends at exactly 60 s
    publish_one(engine)
    await relay.run_until_idle()
    assert (await worker.run_once()).succeeded == 1

    during, after = receiver.requests
    assert [s[:3] for s in during.headers["webhook-signature"].split(" ")] == ["v1,", "v1,"]
    old.verify(during.body, during.headers)
    new.verify(during.body, during.headers)
    [signature] = after.headers["webhook-signature"].split(" ")
    assert signature.startswith("v1,")
    new.verify(after.body, after.headers)
    with pytest.raises(WebhookVerificationError):
        old.verify(after.body, after.headers)


# Both orders: a rule picked by position (first or last) instead of specificity fails one.
# invoice.v is as long as invoice.*: the exact type must win on being exact, not on length.
ORDERS = [
    ("*", "invoice.*", "invoice.paid", "invoice.v"),
    ("invoice.v", "invoice.paid", "invoice.*", "*"),
]


@pytest.mark.parametrize("order", ORDERS, ids=["general-first", "specific-first"])
async def test_the_most_specific_event_type_rule_wins_for_max_attempts_and_schedule(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    http: httpx.AsyncClient,
    order: tuple[str, ...],
) -> None:
    max_attempts = {"*": 3, "invoice.*": 4, "invoice.paid": 5, "invoice.v": 6}
    schedules = {
        "*": (20.0,),
        "invoice.*": (100.0,),
        "invoice.paid": (400.0,),
        "invoice.v": (800.0,),
    }
    add_endpoint(engine, box, receiver.route("/down", status=500))
    for event_type in ("invoice.paid", "invoice.sent", "order.created", "invoice.v"):
        publish_one(engine, event_type)
    relay_config = RelayConfig(max_attempts_by_event_type={p: max_attempts[p] for p in order})
    await Relay(async_engine, clock, relay_config).run_until_idle()
    config = WorkerConfig(
        retry_schedule=(1.0,), retry_schedule_by_event_type={p: schedules[p] for p in order}
    )
    assert (await Worker(async_engine, http, box, clock, config).run_once()).scheduled == 4

    found = delays(engine, clock)
    assert {event_type: attempts for event_type, (attempts, _) in found.items()} == {
        "invoice.paid": 5,  # the exact type beats invoice.* and *
        "invoice.sent": 4,  # invoice.* beats *
        "order.created": 3,  # only * matches
        "invoice.v": 6,  # exact beats invoice.* of the same length
    }
    assert 320 <= found["invoice.paid"][1] <= 480
    assert 80 <= found["invoice.sent"][1] <= 120
    assert 16 <= found["order.created"][1] <= 24
    assert 640 <= found["invoice.v"][1] <= 960
