"""Tenants at publish and relay: an event reaches its own tenant's endpoints only (plus the
endpoints created to take every tenant's events); bad tenant input writes nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import publish, publish_async
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import EndpointError, PublishError, TenantError
from outbox.relay import Relay
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, rows, scalar


def _tenants(engine: Engine, *uids: str) -> None:
    with engine.begin() as conn:
        for uid in uids:
            create_tenant(conn, uid, name=f"Tenant {uid}")


async def test_an_event_reaches_only_its_tenants_endpoints_and_the_all_tenants_ones(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    _tenants(engine, "seller-7", "seller-8")
    seven = add_endpoint(engine, box, "http://127.0.0.1:1/7", "order.*", tenant="seller-7")
    eight = add_endpoint(engine, box, "http://127.0.0.1:1/8", "order.*", tenant="seller-8")
    default = add_endpoint(engine, box, "http://127.0.0.1:1/d", "*")
    warehouse = add_endpoint(engine, box, "http://127.0.0.1:1/w", "*", all_tenants=True)
    with engine.begin() as conn:
        for_seven = publish(conn, "order.created", {"n": 7}, tenant="seller-7")
        for_eight = publish(conn, "order.created", {"n": 8}, tenant="seller-8")
        for_default = publish(conn, "order.created", {"n": 0})

    await Relay(async_engine, clock).run_until_idle()

    fanned = rows(
        engine,
        """SELECT ev.message_id, e.uid, t.uid AS owner FROM deliveries d
           JOIN endpoints e ON e.id = d.endpoint_id JOIN outbox_events ev ON ev.id = d.event_id
           JOIN tenants t ON t.id = d.tenant_id""",
    )
    routed = {(row["message_id"], row["uid"]) for row in fanned}
    assert routed == {
        (for_seven, seven.endpoint.uid),
        (for_seven, warehouse.endpoint.uid),
        (for_eight, eight.endpoint.uid),
        (for_eight, warehouse.endpoint.uid),
        (for_default, default.endpoint.uid),
        (for_default, warehouse.endpoint.uid),
    }
    # A delivery belongs to its endpoint's owner: the warehouse's copies are not seller 7's.
    owners = {(row["uid"], row["owner"]) for row in fanned}
    assert (warehouse.endpoint.uid, "default") in owners
    assert (seven.endpoint.uid, "seller-7") in owners
    assert {owner for uid, owner in owners if uid == warehouse.endpoint.uid} == {"default"}


async def test_idempotency_keys_are_unique_per_tenant(
    engine: Engine, async_engine: AsyncEngine
) -> None:
    _tenants(engine, "a", "b")
    with engine.begin() as conn:
        first_a = publish(conn, "order.created", {}, tenant="a", idempotency_key="order-1")
        again_a = publish(conn, "order.created", {}, tenant="a", idempotency_key="order-1")
        first_b = publish(conn, "order.created", {}, tenant="b", idempotency_key="order-1")
    async with async_engine.begin() as conn:
        again_b = await publish_async(
            conn, "order.created", {}, tenant="b", idempotency_key="order-1"
        )
    assert first_a == again_a
    assert first_b == again_b
    assert first_a != first_b
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 2


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ("nobody", "unknown tenant 'nobody'"),
        ("", "must not be empty"),
        ("x" * 256, "over the limit of 255"),
        ("bad\nid", "control character"),
        ("bad\ud800", "lone surrogate"),
        (7, "must be a string"),
    ],
)
async def test_bad_tenant_on_publish_is_refused_and_the_transaction_stays_usable(
    engine: Engine, async_engine: AsyncEngine, tenant: object, message: str
) -> None:
    with engine.begin() as conn:
        with pytest.raises(PublishError, match=message):
            publish(conn, "order.created", {}, tenant=tenant)  # type: ignore[arg-type]
        # Nothing was written and the caller's transaction still works.
        assert conn.execute(text("SELECT count(*) FROM outbox_events")).scalar() == 0
        publish(conn, "order.created", {})
    async with async_engine.begin() as conn:
        with pytest.raises(PublishError, match=message):
            await publish_async(conn, "order.created", {}, tenant=tenant)  # type: ignore[arg-type]
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1


def test_an_endpoint_for_an_unknown_tenant_is_refused(engine: Engine, box: SecretBox) -> None:
    with pytest.raises(EndpointError, match="unknown tenant 'ghost'"):
        add_endpoint(engine, box, "http://127.0.0.1:1/x", "*", tenant="ghost")
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0


def test_tenant_ids_are_checked_before_anything_is_written(engine: Engine) -> None:
    with pytest.raises(TenantError, match="control character"):
        _tenants(engine, "tab\there")
    _tenants(engine, "seller-7")
    with pytest.raises(TenantError, match="exists already"):
        _tenants(engine, "seller-7")
    assert scalar(engine, "SELECT count(*) FROM tenants") == 2  # default + seller-7
