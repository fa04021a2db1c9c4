"""The gates folded into the claim (queries.CLAIM_FOLDED, delivery/worker/claiming.py):
when the last claim found the gates with nothing to say, the next claim is one statement
that commits by itself, and it takes exactly what the claim through the gates would; a
gate or cap that appears meanwhile sends the claim back through the gates. Real
PostgreSQL, a manual clock."""

from __future__ import annotations

from collections import Counter

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from outbox.tenants import create_tenant, update_tenant
from tests.delivery.test_claiming import stuck_beside_one_live
from tests.helpers import add_endpoint


def release_all(engine: Engine) -> None:
    """Hand every claim back, as if none had happened (the claim number stays bumped)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET state = 'scheduled', locked_by = NULL,"
                " lease_expires_at = NULL WHERE state = 'in_flight'"
            )
        )


async def test_a_claim_after_silent_gates_is_folded_and_takes_what_the_gates_would(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "other")
    flood = add_endpoint(engine, box, "http://127.0.0.1:1/flood", "flood.*")
    few = add_endpoint(engine, box, "http://127.0.0.1:1/few", "few.*")
    theirs = add_endpoint(engine, box, "http://127.0.0.1:1/theirs", "t.*", tenant="other")
    folded = Worker(async_engine, http, box, clock, WorkerConfig())
    # Nothing due: a claim through the gates, which have nothing to say.
    assert await folded.claim(6) == []
    assert folded.gate_paths == {"all": 1}
    with engine.begin() as conn:
        for i in range(10):
            publish(conn, "flood.x", {"i": i})
        publish(conn, "few.x", {})
        for i in range(4):
            publish(conn, "t.x", {"i": i}, tenant="other")
    await Relay(async_engine, clock).run_until_idle()

    batch = await folded.claim(6)
    assert folded.gate_paths == {"all": 1, "folded": 1}
    assert folded.claims == 2
    # Twice each endpoint's share of 6 (4 each), round robin across tenants: the other
    # tenant's first turns come as early as the default tenant's.
    assert Counter(c.endpoint_uid for c in batch) == {
        flood.endpoint.uid: 2,
        few.endpoint.uid: 1,
        theirs.endpoint.uid: 3,
    }
    # The same rows as a claim through the gates (a new worker's first claim).
    release_all(engine)
    gated = Worker(async_engine, http, box, clock, WorkerConfig())
    reference = await gated.claim(6)
    assert "folded" not in gated.gate_paths
    assert sorted(c.id for c in reference) == sorted(c.id for c in batch)


async def test_a_gate_or_cap_that_appears_sends_the_claim_back_through_the_gates(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "capped")
    limited = add_endpoint(engine, box, "http://127.0.0.1:1/limited", "lim.*")
    capped = add_endpoint(engine, box, "http://127.0.0.1:1/capped", "cap.*", tenant="capped")
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    assert await w.claim(10) == []  # the gates, silent: the next claim tries them folded
    with engine.begin() as conn:
        for i in range(5):
            publish(conn, "lim.x", {"i": i})
            publish(conn, "cap.x", {"i": i}, tenant="capped")
        set_endpoint_limits(conn, limited.endpoint.uid, EndpointLimits(max_in_flight=2), actor="t")
        update_tenant(conn, "capped", actor="t", now=clock.now(), max_in_flight=1)
    await Relay(async_engine, clock).run_until_idle()

    batch = await w.claim(10)
    assert Counter(c.endpoint_uid for c in batch) == {
        limited.endpoint.uid: 2,
        capped.endpoint.uid: 1,
    }
    assert "folded" not in w.gate_paths  # tried, found the gates speak, claimed nothing
    # Gates that speak: the next claim goes through them at once, not folded first.
    assert await w.claim(10) == []
    assert "folded" not in w.gate_paths


async def test_a_claim_folded_in_keeps_to_this_workers_share_of_an_endpoints_slots(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """The worker's own slot share per endpoint (its attempts running) is the one limit a
    folded claim applies; an endpoint with none left is not visited, so it is not set
    aside as barren either."""
    busy = add_endpoint(engine, box, "http://127.0.0.1:1/busy", "busy.*")
    free = add_endpoint(engine, box, "http://127.0.0.1:1/free", "free.*")
    w = Worker(async_engine, http, box, clock, WorkerConfig(max_in_flight=8))  # 4 slots each
    assert await w.claim(8) == []
    with engine.begin() as conn:
        for i in range(6):
            publish(conn, "busy.x", {"i": i})
            publish(conn, "free.x", {"i": i})
    await Relay(async_engine, clock).run_until_idle()
    w._slots_held[busy.endpoint.id] = 3  # three attempts to `busy` running here

    batch = await w.claim(8)
    assert w.gate_paths["folded"] == 1
    # `free` has nothing running here: its rows are limited by the batch alone
    assert Counter(c.endpoint_uid for c in batch) == {busy.endpoint.uid: 1, free.endpoint.uid: 6}
    w._slots_held[busy.endpoint.id] = 4
    assert await w.claim(8) == []
    assert w.gate_paths["folded"] == 2
    assert busy.endpoint.id not in w._barren


async def test_a_claim_folded_in_sets_aside_an_endpoint_whose_due_rows_ordering_holds(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    assert await w.claim(4) == []
    live = await stuck_beside_one_live(engine, async_engine, clock, box, 1)
    batch = await w.claim(4)
    assert w.gate_paths["folded"] == 1
    assert [c.endpoint_uid for c in batch] == [live.endpoint.uid]
    stuck = {eid for eid in w._barren if eid != live.endpoint.id}
    assert len(stuck) == 1  # visited, nothing claimable: set aside like the gates' claim does
