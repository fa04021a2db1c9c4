"""outbox.status / status_by_subject: what application code can tell its own user about an
event, driven through every state on a real receiver, and scoped to the tenant asked for."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import outbox
from delivery.receiver import Receiver
from outbox import PublishError, publish, status, status_async, status_by_subject
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.db import libpq_url
from outbox.status import overall_state
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint
from tests.operator_helpers import deliver


def _status(engine: Engine, message_id: str, tenant: str = "default") -> outbox.EventStatus:
    with engine.connect() as conn:
        found = status(conn, message_id, tenant=tenant)
    assert found is not None
    return found


async def test_status_reports_each_state_of_an_event_on_a_real_receiver(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    ok = add_endpoint(engine, box, receiver.route("/ok", status=500), events="invoice.*")
    add_endpoint(engine, box, receiver.route("/refunds", status=400), events="refund.*")
    with engine.begin() as conn:
        paid = publish(conn, "invoice.paid", {"id": "inv_7"}, subject="invoice/inv_7")

    accepted = _status(engine, paid)
    assert (accepted.state, accepted.endpoints, accepted.subject) == (
        "accepted",
        (),
        "invoice/inv_7",
    )

    await deliver(async_engine, box, clock)  # relayed; the first attempt gets a 500
    trying = _status(engine, paid)
    assert trying.state == "in_progress"
    [endpoint] = trying.endpoints
    assert endpoint.endpoint == ok.endpoint.uid
    assert (endpoint.state, endpoint.attempts, endpoint.last_outcome) == (
        "scheduled",
        1,
        "retryable",
    )
    assert endpoint.last_status_code == 500
    assert endpoint.last_error and "500" in endpoint.last_error
    assert endpoint.next_attempt_at is not None and endpoint.next_attempt_at > clock.now()
    assert endpoint.delivered_at is None

    receiver.route("/ok", status=200)
    clock.advance(hours=1)
    await deliver(async_engine, box, clock)
    done = _status(engine, paid)
    assert done.state == "delivered"
    [endpoint] = done.endpoints
    assert (endpoint.state, endpoint.attempts) == ("succeeded", 2)
    assert endpoint.last_outcome == "succeeded"
    assert endpoint.delivered_at == clock.now() and endpoint.next_attempt_at is None

    with engine.begin() as conn:
        refund = publish(conn, "refund.created", {"id": "inv_7"}, subject="invoice/inv_7")
    await deliver(async_engine, box, clock)  # a 400 is permanent: dead at once
    stuck = _status(engine, refund)
    assert stuck.state == "needs_attention"
    assert [(e.state, e.last_outcome, e.last_status_code) for e in stuck.endpoints] == [
        ("dead", "permanent", 400)
    ]

    with engine.connect() as conn:
        by_subject = status_by_subject(conn, "invoice/inv_7")
    assert [(s.message_id, s.state) for s in by_subject] == [
        (refund, "needs_attention"),
        (paid, "delivered"),
    ]
    assert by_subject[1].as_json()["endpoints"][0]["state"] == "succeeded"

    # The async twin, on an AsyncConnection, an AsyncSession and a psycopg connection.
    async with async_engine.connect() as conn:
        assert (await status_async(conn, paid)) == done
    async with AsyncSession(async_engine) as session:
        assert (await status_async(session, refund)) == stuck
    async with await psycopg.AsyncConnection.connect(libpq_url(str(engine.url))) as pg:
        assert (await status_async(pg, refund)) == stuck


def test_another_tenants_event_is_not_found_like_one_that_never_existed(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        create_tenant(conn, "globex")
        mine = publish(conn, "invoice.paid", {"id": 1}, tenant="acme", subject="invoice/1")
    with engine.connect() as conn:
        assert status(conn, mine, tenant="acme") is not None
        assert status(conn, mine, tenant="globex") is None
        assert status(conn, mine) is None  # the default tenant's
        assert status(conn, "msg_nothing", tenant="acme") is None
        assert status(conn, mine, tenant="nobody") is None
        assert status_by_subject(conn, "invoice/1", tenant="globex") == []
        assert [s.message_id for s in status_by_subject(conn, "invoice/1", tenant="acme")] == [mine]
    with psycopg.connect(libpq_url(database_url)) as pg:
        found = status(pg, mine, tenant="acme")
        assert found is not None and found.state == "accepted"


@pytest.mark.parametrize(
    ("subject", "message"),
    [
        ("x" * 256, "at most 255 characters"),
        ("", "at most 255 characters"),
        ("invoice/\ninv_7", "control character"),
        ("invoice/\x00", "control character"),
        ("lone \ud800", "lone surrogate"),
        (7, "non-empty string"),
    ],
)
def test_hostile_subjects_are_refused_before_anything_is_written(
    engine: Engine, subject: object, message: str
) -> None:
    with engine.begin() as conn:
        with pytest.raises(PublishError, match=message):
            publish(conn, "invoice.paid", {"id": 1}, subject=subject)  # type: ignore[arg-type]
        with pytest.raises(PublishError, match=message):
            status_by_subject(conn, subject)  # type: ignore[arg-type]
        assert status_by_subject(conn, "x" * 255) == []  # the longest allowed


@pytest.mark.parametrize("message_id", ["", "msg_\x00", "x" * 256, None])
def test_hostile_message_ids_are_refused_clearly(engine: Engine, message_id: object) -> None:
    with engine.connect() as conn, pytest.raises(PublishError, match="the id publish"):
        status(conn, message_id)  # type: ignore[arg-type]


def test_the_overall_state_rules() -> None:
    """Pure rules: attention wins over progress; held and discarded need a person too."""
    assert overall_state([], relayed=False, rejected=False) == "accepted"
    assert overall_state([], relayed=True, rejected=False) == "delivered"  # nobody subscribed
    assert overall_state([], relayed=True, rejected=True) == "needs_attention"
    assert overall_state(["succeeded", "scheduled"], relayed=True, rejected=False) == (
        "in_progress"
    )
    assert overall_state(["in_flight", "dead"], relayed=True, rejected=False) == ("needs_attention")
    assert overall_state(["succeeded", "held"], relayed=True, rejected=False) == ("needs_attention")
    assert overall_state(["discarded"], relayed=True, rejected=False) == "needs_attention"
    assert overall_state(["succeeded"] * 3, relayed=True, rejected=False) == "delivered"
