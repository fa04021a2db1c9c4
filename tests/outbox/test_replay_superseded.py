"""Replay asks whether the event still stands: a delivery whose event a newer one of the
same type and subject (or ordering key) superseded at the same endpoint is not replayed
unless forced; bulk replay (and its dry run) counts and leaves such deliveries out; the
check reads indexes, not the history."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import deliveries as delivery_ops
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.errors import SupersededError
from outbox.relay import Relay
from outbox.sql.deliveries import SELECT_SUPERSEDING_EVENTS
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, scalar
from tests.outbox.deliveries_helpers import set_state

URL = "https://partner.example/hooks"
OTHER_URL = "https://other.example/hooks"


async def _publish(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    state: str,
    event_type: str = "order.updated",
    **kwargs: Any,
) -> tuple[str, dict[str, int]]:
    """Publish one event, relay it, put its deliveries in `state`; (message id, {endpoint
    uid: delivery id})."""
    with engine.begin() as conn:
        message_id = publish(conn, event_type, {"v": message_counter()}, **kwargs)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        made = conn.execute(
            text(
                "SELECT e.uid, d.id FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id"
                " JOIN outbox_events ev ON ev.id = d.event_id WHERE ev.message_id = :m"
            ),
            {"m": message_id},
        ).all()
        for _, delivery_id in made:
            set_state(conn, delivery_id, state)
    return message_id, {str(uid): int(i) for uid, i in made}


_counter = iter(range(10**6))


def message_counter() -> int:
    return next(_counter)


def _replay(engine: Engine, clock: ManualClock, ids: list[int], **kwargs: Any) -> Any:
    with engine.begin() as conn:
        return delivery_ops.replay(conn, ids, actor="al", reason="fixed", now=clock.now(), **kwargs)


async def test_a_newer_delivered_event_of_the_same_subject_refuses_the_replay(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    _, old = await _publish(engine, async_engine, clock, "dead", subject="order/1")
    newer, _ = await _publish(engine, async_engine, clock, "succeeded", subject="order/1")
    with pytest.raises(SupersededError) as refused:
        _replay(engine, clock, [old[uid]])
    assert str(refused.value) == (
        f"superseded: {old[uid]} by {newer} (a newer event of the same type and subject or "
        "ordering key was delivered to the same endpoint since); replaying would send the older "
        'state after it: add --force (API: "force": true) if that is meant; nothing was replayed'
    )
    assert refused.value.superseded == {old[uid]: newer}
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE replay_of IS NOT NULL") == 0
    forced = _replay(engine, clock, [old[uid]], force=True)
    assert [o for o, _ in forced.replayed] == [old[uid]]


async def test_the_same_ordering_key_supersedes_too(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    _, old = await _publish(engine, async_engine, clock, "dead", ordering_key="cust-1")
    newer, _ = await _publish(engine, async_engine, clock, "succeeded", ordering_key="cust-1")
    with pytest.raises(SupersededError, match=newer):
        _replay(engine, clock, [old[uid]])


async def test_what_does_not_supersede(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Another type, another endpoint, a newer one not delivered, an older one delivered,
    another subject, or another tenant's event of the same subject: the replay goes."""
    uid = add_endpoint(engine, box, URL).endpoint.uid
    with engine.begin() as conn:
        create_tenant(conn, "acme")
    other = add_endpoint(engine, box, OTHER_URL, tenant="acme", all_tenants=True).endpoint.uid
    await _publish(engine, async_engine, clock, "succeeded", subject="order/1")  # older
    _, old = await _publish(engine, async_engine, clock, "dead", subject="order/1")
    await _publish(engine, async_engine, clock, "succeeded", "order.cancelled", subject="order/1")
    await _publish(engine, async_engine, clock, "dead", subject="order/1")  # newer, not delivered
    await _publish(engine, async_engine, clock, "succeeded", subject="order/2")
    await _publish(
        engine, async_engine, clock, "succeeded", subject="order/1", tenant="acme"
    )  # acme's order/1 reaches `other` only (all_tenants), never `uid`
    with engine.connect() as conn:
        assert delivery_ops.superseded_by(conn, [old[uid], old[other]]) == {}
    assert len(_replay(engine, clock, [old[uid], old[other]]).replayed) == 2


async def test_bulk_replay_and_its_dry_run_count_the_superseded_and_leave_them_out(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    uid = add_endpoint(engine, box, URL).endpoint.uid
    _, stale = await _publish(engine, async_engine, clock, "dead", subject="order/1")
    _, fresh = await _publish(engine, async_engine, clock, "dead", subject="order/2")
    newer, _ = await _publish(engine, async_engine, clock, "succeeded", subject="order/1")
    flt = delivery_ops.DeliveryFilter(states=("dead",))

    def bulk(**kwargs: Any) -> delivery_ops.ReplayResult:
        with engine.begin() as conn:
            return delivery_ops.bulk_replay(
                conn, flt, actor="al", reason="fixed", now=clock.now(), **kwargs
            )

    dry = bulk(dry_run=True)
    assert (dry.matched, dry.superseded) == (2, {stale[uid]: newer})
    assert dry.as_json()["superseded"] == 1
    assert dry.as_json()["superseded_sample"] == [
        {"delivery": stale[uid], "newer_message_id": newer}
    ]
    assert bulk(dry_run=True, force=True).superseded == {}
    done = bulk()
    assert [o for o, _ in done.replayed] == [fresh[uid]]
    assert done.superseded == {stale[uid]: newer}
    forced = bulk(force=True)  # only the superseded one is left unreplayed
    assert [o for o, _ in forced.replayed] == [stale[uid]]


async def test_the_subject_filter_finds_a_subjects_deliveries_only_in_scope(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
    mine = add_endpoint(engine, box, URL).endpoint.uid
    add_endpoint(engine, box, OTHER_URL, tenant="acme")
    _, first = await _publish(engine, async_engine, clock, "dead", subject="order/1")
    await _publish(engine, async_engine, clock, "dead", subject="order/2")
    await _publish(engine, async_engine, clock, "dead", subject="order/1", tenant="acme")
    with engine.connect() as conn:
        found = delivery_ops.search_deliveries(
            conn, delivery_ops.DeliveryFilter(subject="order/1", tenant="default")
        )
    assert [(d.id, d.subject) for d in found] == [(first[mine], "order/1")]


def test_the_check_reads_indexes_not_the_history(engine: Engine, box: SecretBox) -> None:
    """EXPLAIN over 20,000 events and deliveries (one endpoint, many subjects and keys): no
    sequential scan of events or deliveries, whatever the planner's statistics say."""
    endpoint = add_endpoint(engine, box, URL).endpoint.uid
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, subject,
                                           ordering_key, relayed_at)
                SELECT 'msg_' || g, (SELECT id FROM tenants WHERE uid = 'default'),
                       'order.updated', '{}', 'order/' || (g % 5000), 'k' || (g % 5000), now()
                FROM generate_series(1, 20000) g
                """
            )
        )
        conn.execute(
            text(
                """
                INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, attempts,
                                        max_attempts, next_attempt_at, ordering_key,
                                        completed_at)
                SELECT ev.id, e.id, e.tenant_id, 'succeeded', 1, 5, now(), ev.ordering_key,
                       now()
                FROM outbox_events ev, endpoints e WHERE e.uid = :uid
                """
            ),
            {"uid": endpoint},
        )
        conn.execute(text("ANALYZE outbox_events"))
        conn.execute(text("ANALYZE deliveries"))
        ids = list(conn.execute(text("SELECT id FROM deliveries ORDER BY id LIMIT 3")).scalars())
        explain = text("EXPLAIN " + SELECT_SUPERSEDING_EVENTS.text)
        plan = "\n".join(conn.execute(explain, {"ids": ids}).scalars())
        assert len(delivery_ops.superseded_by(conn, ids)) == 3
    assert "Seq Scan on outbox_events" not in plan, plan
    assert "Seq Scan on deliveries" not in plan, plan
    assert "ix_outbox_events_tenant_id_subject" in plan, plan
    assert "ix_deliveries_ordering" in plan, plan
