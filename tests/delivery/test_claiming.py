"""The worker's claims (delivery/worker/claiming.py): a claim that needs more than one
round (endpoints whose due rows per-key ordering holds are set aside and the same claim
goes on to the others, within its batch and its rounds), and this worker's share of
slots per endpoint. Real PostgreSQL, a manual clock, a real receiver on 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections import Counter

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import EndpointLimits, set_endpoint_limits
from delivery.policy import Outcome
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from delivery.worker import BARREN_FOR, Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, signing_key
from outbox.endpoint_auth import check_client_certificate, check_oauth_client, set_endpoint_auth
from outbox.endpoint_rules import DeliveryRules, set_delivery_rules
from outbox.endpoints import CreatedEndpoint, set_failure_policy, set_proxy
from outbox.headers import set_headers
from outbox.relay import Relay
from outbox.tenants import DEFAULT_TENANT, create_tenant
from tests.delivery.pki import NOW, Authority
from tests.helpers import add_endpoint, rows, until


async def stuck_endpoints(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    count: int,
    tenant: str = DEFAULT_TENANT,
) -> list[CreatedEndpoint]:
    """`count` ordered endpoints whose one due row waits behind its key's dead head (block):
    each has a head, and nothing a claim may take."""
    stuck = [
        add_endpoint(engine, box, f"http://127.0.0.1:1/s{i}", "blk.*", tenant=tenant)
        for i in range(count)
    ]
    with engine.begin() as conn:
        for endpoint in stuck:
            set_endpoint_limits(
                conn, endpoint.endpoint.uid, EndpointLimits(ordered=True), actor="test"
            )
        first = publish(conn, "blk.x", {}, ordering_key="k", tenant=tenant)
        publish(conn, "blk.x", {}, ordering_key="k", tenant=tenant)
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        conn.execute(
            text(
                """UPDATE deliveries SET state = 'dead', completed_at = now()
                   WHERE event_id = (SELECT id FROM outbox_events WHERE message_id = :m)"""
            ),
            {"m": first},
        )
    return stuck


def due_since(engine: Engine, endpoint: CreatedEndpoint, at: dt.datetime) -> None:
    """The endpoint's scheduled rows fell due at `at` (heads' age decides the claim order)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET next_attempt_at = :at"
                " WHERE endpoint_id = :e AND state = 'scheduled'"
            ),
            {"at": at, "e": endpoint.endpoint.id},
        )


def due_in_order(engine: Engine, endpoints: list[CreatedEndpoint], now: dt.datetime) -> None:
    """Each endpoint's rows fell due an hour after the one before it: a claim visits them
    in this order."""
    for age, endpoint in enumerate(endpoints):
        due_since(engine, endpoint, now - dt.timedelta(hours=10 - age))


async def stuck_beside_one_live(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox, count: int
) -> CreatedEndpoint:
    """`count` stuck endpoints, then one live endpoint (returned) with one due delivery, in
    that order."""
    stuck = await stuck_endpoints(engine, async_engine, clock, box, count)
    live = add_endpoint(engine, box, "http://127.0.0.1:1/live", "live.*")
    with engine.begin() as conn:
        publish(conn, "live.x", {})
    await Relay(async_engine, clock).run_until_idle()
    due_in_order(engine, [*stuck, live], clock.now())
    return live


async def test_a_second_round_fills_the_batch_to_its_limit_and_keeps_the_first_rounds_claims(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    w = Worker(async_engine, http, box, clock, WorkerConfig(lease_seconds=60))
    assert await w.claim(4) == []
    assert w.claims == 1  # nothing due: one round, not three
    stuck = await stuck_endpoints(engine, async_engine, clock, box, 3)
    live = add_endpoint(engine, box, "http://127.0.0.1:1/live", "live.*")
    backlog = add_endpoint(engine, box, "http://127.0.0.1:1/bulk", "bulk.*")
    with engine.begin() as conn:
        for i in range(3):
            publish(conn, "live.x", {"i": i})
        for i in range(10):
            publish(conn, "bulk.x", {"i": i})
    await Relay(async_engine, clock).run_until_idle()
    now = clock.now()
    due_in_order(engine, [*stuck, live, backlog], now)
    # Round 1 visits the four oldest heads: three stuck endpoints and `live`, which gives
    # two rows (twice its share of 4). Round 2 sets the stuck ones aside and takes the two
    # rows the batch has room for, from `live` and `backlog`.
    batch = await w.claim(4)
    assert w.claims == 3
    assert len(batch) == 4
    assert Counter(c.endpoint_uid for c in batch) == {
        live.endpoint.uid: 3,
        backlog.endpoint.uid: 1,
    }
    # Each row is sent as its own event type (one claim prepares both types).
    types = {live.endpoint.uid: "live.x", backlog.endpoint.uid: "bulk.x"}
    for claimed in batch:
        assert claimed.event_type == types[claimed.endpoint_uid]
        assert json.loads(claimed.request.body)["type"] == claimed.event_type
    # The batch is exactly what this claim leased: no row is leased and left out of it.
    leased = rows(engine, "SELECT id, lease_expires_at FROM deliveries WHERE state = 'in_flight'")
    assert sorted(r["id"] for r in leased) == sorted(c.id for c in batch)
    assert {r["lease_expires_at"] for r in leased} == {now + dt.timedelta(seconds=60)}


async def test_a_claim_stops_after_three_rounds_and_the_next_one_starts_past_them(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """A claim's cost is bounded: three rounds of `limit` endpoints at most. What they found
    barren stays set aside for the next claim, which then reaches the rest at once."""
    live = await stuck_beside_one_live(engine, async_engine, clock, box, 6)
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    assert await w.claim(2) == []
    assert w.claims == 3
    # Set aside for BARREN_FOR exactly: then the stuck endpoints' turn comes back (and the
    # claim spends its rounds on them again), so a key that frees up is not left waiting.
    clock.advance(BARREN_FOR.total_seconds())
    assert await w.claim(2) == []
    assert w.claims == 6
    batch = await w.claim(2)
    assert [c.endpoint_uid for c in batch] == [live.endpoint.uid]


async def test_among_many_tenants_the_quick_path_also_sets_stuck_endpoints_aside(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """With a batch's worth of tenants the batch comes from the oldest due rows alone
    (queries.QUICK_CLAIM_GATES); the endpoints its first round found stuck go last there
    too, so the same claim reaches the live one."""
    stuck = []
    for t in range(3):
        with engine.begin() as conn:
            create_tenant(conn, f"t{t}")
        stuck += await stuck_endpoints(engine, async_engine, clock, box, 1, tenant=f"t{t}")
    with engine.begin() as conn:
        create_tenant(conn, "live")
    live = add_endpoint(engine, box, "http://127.0.0.1:1/live", "live.*", tenant="live")
    with engine.begin() as conn:
        publish(conn, "live.x", {}, tenant="live")
    await Relay(async_engine, clock).run_until_idle()
    due_in_order(engine, [*stuck, live], clock.now())
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    batch = await w.claim(2)
    assert [c.endpoint_uid for c in batch] == [live.endpoint.uid]
    assert w.gate_paths["quick"] >= 1


async def test_a_claim_whose_first_round_fills_the_batch_runs_no_other(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """A barren endpoint and more left out would call for another round, but the batch is
    full: another round would lock the gates again to claim nothing."""
    stuck = await stuck_endpoints(engine, async_engine, clock, box, 1)
    busy = [add_endpoint(engine, box, f"http://127.0.0.1:1/b{i}", f"b{i}.*") for i in range(4)]
    with engine.begin() as conn:
        for i in range(4):
            for _ in range(2):
                publish(conn, f"b{i}.x", {})
    await Relay(async_engine, clock).run_until_idle()
    due_in_order(engine, [*stuck, *busy], clock.now())
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    # The stuck endpoint and three busy ones are visited (the fourth is left out); two
    # rows from each of two busy endpoints fill the batch.
    batch = await w.claim(4)
    assert len(batch) == 4
    assert w.claims == 1


async def test_an_endpoint_takes_at_most_its_share_of_this_workers_slots(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
    receiver: Receiver,
) -> None:
    """Four slots, two per endpoint: with its two attempts still running, an endpoint with
    older due rows is not claimed again, and a newer one takes the other two slots.
    (In-flight limits of their own make both endpoints gated, so the claims read every
    candidate and this worker's share is applied to the budgets.)"""
    release = asyncio.Event()

    async def hold(_: ReceivedRequest) -> Behaviour:
        await release.wait()
        return Behaviour()

    busy = add_endpoint(engine, box, receiver.route("/busy", hold), "busy.*")
    other = add_endpoint(engine, box, receiver.route("/other", hold), "other.*")
    with engine.begin() as conn:
        for endpoint in (busy, other):
            limits = EndpointLimits(max_in_flight=10)
            set_endpoint_limits(conn, endpoint.endpoint.uid, limits, actor="test")
        for _ in range(4):
            publish(conn, "busy.x", {})
        for _ in range(2):
            publish(conn, "other.x", {})
    await Relay(async_engine, clock).run_until_idle()
    now = clock.now()
    due_since(engine, busy, now - dt.timedelta(hours=2))
    due_since(engine, other, now - dt.timedelta(hours=1))
    w = Worker(async_engine, http, box, clock, WorkerConfig(max_in_flight=4, batch_size=1))
    assert w.config.endpoint_slots == 2
    stop = asyncio.Event()
    running = asyncio.create_task(w.run(stop))
    try:
        await until(lambda: len(receiver.requests) == 4, "four attempts in flight")
        assert Counter(r.path for r in receiver.requests) == {"/busy": 2, "/other": 2}
    finally:
        release.set()
        stop.set()
        await running


async def test_a_round_that_visited_every_candidate_is_not_repeated(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """A stuck endpoint beside all the others: nothing was left out, so another round
    would visit the same endpoints again and find nothing more."""
    live = await stuck_beside_one_live(engine, async_engine, clock, box, 1)
    w = Worker(async_engine, http, box, clock, WorkerConfig())
    batch = await w.claim(4)
    assert [c.endpoint_uid for c in batch] == [live.endpoint.uid]
    assert w.claims == 1


async def test_each_claimed_row_carries_its_own_endpoints_settings(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    http: httpx.AsyncClient,
) -> None:
    """One claim prepares rows of three endpoints: two with every setting of their own
    (client certificate, OAuth client, proxy, headers, status overrides, hold, timeout,
    schedule), one with none. Each row gets its own endpoint's values, decrypted, never
    another's: the decrypted values are memoized per ciphertext, and a wrong memo key
    would present endpoint a's certificate, token or proxy to endpoint b. Two events
    in the same claim: the endpoint's parts are worked out once per endpoint and the
    envelope once per event in a batch, and each row still gets its own event's body."""
    authority = Authority("claims client CA")
    settings = {}
    secrets: dict[str, str] = {}
    for name, status, timeout in (("a", 404, 3.0), ("b", 500, 4.0)):
        created = add_endpoint(engine, box, f"https://127.0.0.1:1/{name}", "order.*")
        uid = created.endpoint.uid
        cert, key = authority.issue(f"endpoint-{name}")
        certificate, certificate_summary = check_client_certificate(cert, key, now=NOW)
        oauth, oauth_summary = check_oauth_client(
            "https://127.0.0.1:1/token", f"app-{name}", f"secret-{name}", None
        )
        proxy = f"http://user-{name}:pw@127.0.0.1:3{status}"
        rules = DeliveryRules(
            timeout_seconds=timeout,
            retry_schedule=(float(status),),
            status_overrides={status: "retryable"},
        )
        with engine.begin() as conn:
            set_endpoint_auth(
                conn, box, uid, client_certificate=certificate,
                certificate_summary=certificate_summary, oauth=oauth,
                oauth_summary=oauth_summary, actor="t",
            )  # fmt: skip
            set_proxy(conn, box, uid, proxy, actor="t")
            set_headers(conn, box, uid, {"X-Partner": name}, actor="t")
            set_delivery_rules(conn, uid, rules, actor="t")
            if name == "a":
                set_failure_policy(conn, uid, actor="t", on_ambiguous="hold")
        settings[uid] = (certificate, oauth, proxy, status, timeout, name)
        secrets[uid] = created.secret
    created = add_endpoint(engine, box, "http://127.0.0.1:1/plain", "order.*")
    plain = created.endpoint.uid
    secrets[plain] = created.secret
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with engine.begin() as conn:
        payloads = {publish(conn, "order.created", {"id": n}): n for n in (1, 2)}
        conn.execute(
            text("UPDATE outbox_events SET traceparent = :t WHERE message_id = ANY(:m)"),
            {"t": traceparent, "m": list(payloads)},
        )
    await Relay(async_engine, clock).run_until_idle()
    config = WorkerConfig(
        request_timeout=7.0,
        retry_after_max=123.0,
        retry_schedule_by_event_type={"order.*": (77.0,)},
    )
    batch = await Worker(async_engine, http, box, clock, config).claim(10)
    assert sorted(c.endpoint_uid for c in batch) == sorted([*settings, plain] * 2)
    for claimed in batch:
        request = claimed.request
        assert request.delivery_id == claimed.id
        envelope = json.loads(request.body)
        assert (envelope["type"], envelope["data"]) == (
            "order.created",
            {"id": payloads[request.message_id]},
        )
        assert request.keys == [signing_key(secrets[claimed.endpoint_uid])]
        assert claimed.traceparent == traceparent
        assert request.retry_after_max == 123.0
        if claimed.endpoint_uid == plain:
            assert claimed.hold_ambiguous is False
            assert (request.proxy, request.client_certificate, request.oauth) == (None,) * 3
            assert (dict(request.extra_headers), dict(request.status_overrides)) == ({}, {})
            assert (request.timeout, claimed.policy.schedule) == (7.0, (77.0,))
            assert request.url == "http://127.0.0.1:1/plain"
            continue
        certificate, oauth, proxy, status, timeout, name = settings[claimed.endpoint_uid]
        assert claimed.hold_ambiguous is (name == "a")
        assert request.client_certificate == certificate
        assert request.oauth == oauth
        assert request.proxy == proxy
        assert request.extra_headers == {"x-partner": name}
        assert request.url == f"https://127.0.0.1:1/{name}"
        assert request.status_overrides == {status: Outcome.RETRYABLE}
        assert (request.timeout, claimed.policy.schedule) == (timeout, (float(status),))
