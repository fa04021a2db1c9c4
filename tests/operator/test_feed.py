"""The catch-up feed (outbox/feeds.py, GET /feed/v1/{endpoint}) end to end: a partner whose
receiver was down pulls what it missed, in order, and verifies every item with the
Standard Webhooks library as if it had been POSTed; nobody else's endpoint is reachable."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from openapi_spec_validator import validate
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from delivery.http import build_http_client
from delivery.operator.api import create_app
from delivery.operator.cli import main
from delivery.receiver import Receiver
from delivery.retention import Retention, RetentionConfig
from delivery.worker import Worker, WorkerConfig
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.deliveries import replay
from outbox.endpoints import CreatedEndpoint
from outbox.errors import EndpointError, FeedError
from outbox.feeds import cursor_for, parse_cursor, rotate_feed_token, set_delivery_mode
from outbox.relay import Relay
from outbox.sql.feeds import SELECT_FEED_PAGE
from outbox.sql.relay import RELAY_BATCH
from outbox.tenants import create_tenant
from outbox.testevents import send_test_event
from outbox.tokens import create_token
from tests.helpers import LOOPBACK, add_endpoint, rows, scalar

OTHER = "seller-b"


@dataclass
class Partner:
    """The feed as a partner sees it: its endpoint, its token, an HTTP client."""

    http: httpx.AsyncClient
    created: CreatedEndpoint

    @property
    def uid(self) -> str:
        return self.created.endpoint.uid

    @property
    def auth(self) -> dict[str, str]:
        assert self.created.feed_token is not None
        return {"authorization": f"Bearer {self.created.feed_token}"}

    async def get(self, uid: str | None = None, **params: Any) -> httpx.Response:
        return await self.http.get(f"/feed/v1/{uid or self.uid}", params=params, headers=self.auth)

    async def catch_up(
        self, after: str | None = None, limit: int = 2, *, verify: bool = True
    ) -> list[dict[str, Any]]:
        """Page through the feed from `after` to its end, verifying every item (unless the
        test's clock runs days ahead of the library's wall clock)."""
        verified = []
        while True:
            params: dict[str, Any] = {"limit": limit}
            if after is not None:
                params["after"] = after
            answer = await self.get(**params)
            assert answer.status_code == 200, answer.text
            page = answer.json()
            for item in page["items"]:
                # Exactly what a receiver does with a POST: verify the raw body with the
                # headers, then parse it.
                payload = (
                    Webhook(self.created.secret).verify(item["body"], item["headers"])
                    if verify
                    else json.loads(item["body"])
                )
                verified.append({"id": item["headers"]["webhook-id"], **payload})
            after = page["next_cursor"]
            if not page["items"]:
                return verified


@pytest.fixture
async def api(async_engine: AsyncEngine, box: SecretBox, clock: ManualClock) -> AsyncIterator[Any]:
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        yield http


async def test_a_receiver_down_during_publishing_catches_up_through_the_feed_in_order(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    api: httpx.AsyncClient,
) -> None:
    # The partner's receiver is down: its port is closed.
    receiver = await Receiver().start()
    port = receiver.port
    await receiver.stop()
    both = add_endpoint(engine, box, receiver.url("/hooks"), "order.*", delivery_mode="both")
    pull = add_endpoint(engine, box, "https://pull.example/x", "order.*", delivery_mode="pull")
    with engine.begin() as conn:
        create_tenant(conn, OTHER)
    theirs = add_endpoint(
        engine, box, "https://b.example/x", "*", tenant=OTHER, delivery_mode="pull"
    )
    sent = []
    for n in range(5):
        with engine.begin() as conn:
            sent.append(publish(conn, "order.created", {"n": n}))
    with engine.begin() as conn:
        publish(conn, "order.created", {"n": "theirs"}, tenant=OTHER)

    async with build_http_client(max_connections=4, timeout=2, allowed_networks=LOOPBACK) as client:
        worker = Worker(async_engine, client, box, clock, WorkerConfig(retry_schedule=(60.0,)))
        relayed = await Relay(async_engine, clock).run_until_idle()
        assert (relayed.deliveries, relayed.fed) == (5, 11)  # pushes for `both` only
        stats = await worker.run_once()
        assert (stats.claimed, stats.succeeded, stats.scheduled) == (5, 0, 5)  # refused

        # The pull-only endpoints have no delivery row: nothing for a worker, nothing pending.
        for created in (pull, theirs):
            assert (
                scalar(
                    engine,
                    "SELECT count(*) FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id "
                    "WHERE e.uid = :uid",
                    uid=created.endpoint.uid,
                )
                == 0
            )

        # Back up: both partners page through what they missed, in publishing order.
        for created in (both, pull):
            caught_up = await Partner(api, created).catch_up()
            assert [item["id"] for item in caught_up] == sent
            assert [item["data"]["n"] for item in caught_up] == [0, 1, 2, 3, 4]
            assert all(item["type"] == "order.created" for item in caught_up)

        # The pushes still go out once the receiver is back, with the same webhook-id, so
        # a receiver that got an event both ways de-duplicates it.
        async with Receiver(port=port) as back:
            back.route("/hooks", status=204)
            for _ in range(20):  # the breaker opened: a probe first, then the ramp
                clock.advance(60)
                await worker.run_once()
                if len(back.requests) == 5:
                    break
            assert sorted(r.headers["webhook-id"] for r in back.requests) == sorted(sent)

    # Another tenant's endpoint id answers 404 with a valid token of one's own; so does
    # one's own token on one's other endpoint.
    partner = Partner(api, pull)
    assert (await partner.get(theirs.endpoint.uid)).status_code == 404
    assert (await partner.get(both.endpoint.uid)).status_code == 404
    assert (await Partner(api, theirs).get(pull.endpoint.uid)).status_code == 404
    # Their own feed holds only their event.
    assert [i["data"] for i in await Partner(api, theirs).catch_up()] == [{"n": "theirs"}]


async def test_a_rotated_or_missing_feed_token_is_refused(
    engine: Engine, box: SecretBox, api: httpx.AsyncClient
) -> None:
    created = add_endpoint(engine, box, "https://pull.example/x", "*", delivery_mode="pull")
    partner = Partner(api, created)
    assert (await partner.get()).status_code == 200
    with engine.begin() as conn:
        fresh = rotate_feed_token(conn, created.endpoint.uid, actor="test")
    old = await partner.get()
    assert old.status_code == 401 and "rotated or revoked" in old.json()["error"]
    assert old.headers["www-authenticate"] == "Bearer"
    renewed = await api.get(
        f"/feed/v1/{created.endpoint.uid}", headers={"authorization": f"Bearer {fresh}"}
    )
    assert renewed.status_code == 200
    for header in ({}, {"authorization": "Bearer"}, {"authorization": "Basic abc"}):
        answer = await api.get(f"/feed/v1/{created.endpoint.uid}", headers=header)
        assert answer.status_code == 401 and "no feed token" in answer.json()["error"]
    uid = created.endpoint.uid
    for forged in (
        f"obf_{uid}.",  # no secret
        f"obf_{uid}.{'0' * 64}",  # the wrong one
        f"obf_{uid}",
        f"obf_ep_{'f' * 32}.{fresh.rsplit('.', 1)[1]}",  # the right secret, another id
        f"obf_../../{uid}.x",
        "obf_" + "x" * 10_000,
        f"obx_{uid}.{fresh.rsplit('.', 1)[1]}",  # an admin token's prefix
    ):
        answer = await api.get(f"/feed/v1/{uid}", headers={"authorization": f"Bearer {forged}"})
        assert answer.status_code == 401, forged
    # The admin token does not open a feed either.
    assert (await api.get(f"/feed/v1/{uid}")).status_code == 401


async def test_a_push_endpoint_has_no_feed_until_it_pulls(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox,
    api: httpx.AsyncClient,
) -> None:  # fmt: skip
    created = add_endpoint(engine, box, "https://push.example/x", "*")
    assert created.feed_token is None
    with engine.begin() as conn:
        token = set_delivery_mode(conn, created.endpoint.uid, "pull", actor="test")
        assert token is not None
        # A second switch keeps the token (none is shown again).
        assert set_delivery_mode(conn, created.endpoint.uid, "both", actor="test") is None
        token = rotate_feed_token(conn, created.endpoint.uid, actor="test")
        with pytest.raises(EndpointError, match="not one of: push"):
            set_delivery_mode(conn, created.endpoint.uid, "poll", actor="test")
        set_delivery_mode(conn, created.endpoint.uid, "push", actor="test")
    auth = {"authorization": f"Bearer {token}"}
    # Push again: the token is valid but there is no feed to read.
    assert (await api.get(f"/feed/v1/{created.endpoint.uid}", headers=auth)).status_code == 404


async def test_hostile_cursors_and_limits_get_a_clear_400(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox,
    api: httpx.AsyncClient,
) -> None:  # fmt: skip
    mine = add_endpoint(engine, box, "https://pull.example/a", "*", delivery_mode="pull")
    other = add_endpoint(engine, box, "https://pull.example/b", "*", delivery_mode="pull")
    with engine.begin() as conn:
        for n in range(3):
            publish(conn, "order.created", {"n": n})
    await Relay(async_engine, clock).run_until_idle()
    partner = Partner(api, mine)
    first = (await partner.get(limit=1)).json()
    assert first["has_more"] is True and len(first["items"]) == 1
    uid = mine.endpoint.uid
    position, tag = first["next_cursor"].split(".")
    hostile = {
        "limit": ["0", "-1", "1001", "99999999999999999999", "1.5", "ten", "\uff11"],
        "after": [
            "-1",
            "abc",
            "1",  # no tag
            f"{position}.{'0' * 12}",  # forged tag
            cursor_for(other.endpoint.uid, 1),  # a cursor from another endpoint's feed
            f"{int(position) + 1}.{tag}",  # a tag of another position
            "9" * 30 + "." + tag,
            cursor_for(uid, 10**17),  # well formed, past the end
            "1." + "a" * 60,
        ],
    }
    for name, values in hostile.items():
        for value in values:
            answer = await partner.get(**{name: value})
            assert answer.status_code == 400, (name, value, answer.text)
            assert answer.json()["error"]
    past = await partner.get(after=cursor_for(uid, 99))
    assert "past the end" in past.json()["error"]
    foreign = await partner.get(after=cursor_for(other.endpoint.uid, 1))
    assert "not one this feed gave out" in foreign.json()["error"]
    # A huge limit is refused, not served: at most 1,000 items a page.
    huge = await partner.get(limit=5000)
    assert huge.status_code == 400 and "limit" in huge.text and "1000" in huge.text


async def test_a_cursor_older_than_retention_answers_410_with_the_oldest_cursor(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    api: httpx.AsyncClient,
) -> None:
    created = add_endpoint(engine, box, "https://pull.example/x", "*", delivery_mode="pull")
    partner = Partner(api, created)
    for n in range(3):
        with engine.begin() as conn:
            publish(conn, "order.created", {"n": n})
        await Relay(async_engine, clock).run_until_idle()
        clock.advance(3600)
    start = (await partner.get(limit=1)).json()["next_cursor"]  # after event 0
    # Eight days later, with a week's retention, events 0 and 1 are gone (2 is newer).
    clock.advance(dt.timedelta(days=7, hours=-1.5).total_seconds())
    pruned = await Retention(async_engine, clock, RetentionConfig(retention_days=7)).run_once()
    assert (pruned.feed_entries, pruned.events) == (2, 2)
    gone = await partner.get(after=start)
    assert gone.status_code == 410
    assert "pruned by retention" in gone.json()["error"]
    oldest = gone.json()["oldest_cursor"]
    assert [i["data"]["n"] for i in await partner.catch_up(oldest, verify=False)] == [2]
    # Starting without a cursor starts at the oldest event kept.
    assert [i["data"]["n"] for i in await partner.catch_up(verify=False)] == [2]
    # The event the feed still lists was kept, although no delivery references it.
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1


async def test_a_feed_page_is_a_range_scan_of_its_own_endpoint(
    engine: Engine, box: SecretBox
) -> None:
    """Cost follows the page: the primary key (endpoint_id, position), never a scan of
    other endpoints' entries."""
    mine = add_endpoint(engine, box, "https://pull.example/a", "*", delivery_mode="pull")
    busy = add_endpoint(engine, box, "https://pull.example/b", "*", delivery_mode="pull")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_events (tenant_id, message_id, event_type, payload, "
                "relayed_at) SELECT t.id, 'msg_' || i, 'order.created', '{}', now() "
                "FROM tenants t, generate_series(1, 20000) i WHERE t.uid = 'default'"
            )
        )
        for created, share in ((busy, 19_990), (mine, 10)):
            conn.execute(
                text(
                    "INSERT INTO feed_entries (endpoint_id, position, event_id) "
                    "SELECT e.id, row_number() OVER (ORDER BY o.id), o.id FROM endpoints e, "
                    "(SELECT id FROM outbox_events ORDER BY id LIMIT :n) o WHERE e.uid = :uid"
                ),
                {"uid": created.endpoint.uid, "n": share},
            )
        conn.execute(text("ANALYZE feed_entries"))
        conn.execute(text("ANALYZE outbox_events"))
        endpoint_id = conn.execute(
            text("SELECT id FROM endpoints WHERE uid = :uid"), {"uid": mine.endpoint.uid}
        ).scalar()
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                text(f"EXPLAIN {SELECT_FEED_PAGE.text}"),
                {"endpoint_id": endpoint_id, "after": 0, "limit": 100},
            )
        )
    assert "Index Scan using pk_feed_entries on feed_entries" in plan, plan
    assert "Seq Scan" not in plan, plan


@given(position=st.integers(min_value=0, max_value=10**17), junk=st.text(max_size=40))
def test_cursors_round_trip_and_nothing_else_parses(position: int, junk: str) -> None:
    uid = "ep_" + "a" * 32
    assert parse_cursor(uid, cursor_for(uid, position)) == position
    if junk and junk != cursor_for(uid, position):
        try:
            parsed = parse_cursor(uid, junk)
        except FeedError:
            return
        assert parsed is not None and junk == cursor_for(uid, parsed)


def test_the_cli_sets_mode_and_filter_and_rotates_the_feed_token(
    database_url: str, monkeypatch: pytest.MonkeyPatch, engine: Engine
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    cli = CliRunner()

    def run(*args: str) -> Any:
        result = cli.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    added = run(
        "endpoints", "add", "https://example.com/h", "--events", "*", "--mode", "pull",
        "--filter", '$.amount >= 100 && $.currency == "EUR"', "--json",
    )  # fmt: skip
    assert added["delivery_mode"] == "pull" and added["feed_token"].startswith("obf_")
    assert added["payload_filter"] == '$.amount >= 100 && $.currency == "EUR"'
    uid = added["id"]
    token_hash = scalar(engine, "SELECT feed_token_hash FROM endpoints WHERE uid = :u", u=uid)
    assert token_hash and added["feed_token"].split(".")[1] not in token_hash  # hashed
    rotated = run("endpoints", "feed-token", uid, "--json")
    assert rotated["feed_token"] != added["feed_token"]
    cleared = run("endpoints", "update", uid, "--filter", "", "--mode", "both", "--json")
    assert (cleared["payload_filter"], cleared["delivery_mode"]) == (None, "both")
    assert "feed_token" not in cleared  # it had one: not shown again
    refused = cli.invoke(main, ["endpoints", "update", uid, "--filter", "$.amount >"])
    assert refused.exit_code != 0
    assert "not a valid SQL/JSON path: syntax error" in refused.output
    text_add = cli.invoke(
        main, ["endpoints", "add", "https://example.com/p", "--events", "*", "--mode", "both"]
    )
    assert "feed token: obf_" in text_add.output


async def test_retention_never_drops_an_event_another_feed_still_lists(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    api: httpx.AsyncClient,
) -> None:
    """Pruning in small batches: an event leaves only with its last feed entry, so a feed
    whose entry was not pruned yet never loses it silently (no gap without a 410)."""
    first = add_endpoint(engine, box, "https://a.example/x", "*", delivery_mode="pull")
    second = add_endpoint(engine, box, "https://b.example/x", "*", delivery_mode="pull")
    with engine.begin() as conn:
        for n in range(2):
            publish(conn, "order.created", {"n": n})
    await Relay(async_engine, clock).run_until_idle()
    clock.advance(dt.timedelta(days=8).total_seconds())
    config = RetentionConfig(retention_days=7, batch_size=1)
    await Retention(async_engine, clock, config).run_once()  # one feed entry, one event
    for created in (first, second):
        start = cursor_for(created.endpoint.uid, 0)
        answer = await Partner(api, created).get(after=start)
        if answer.status_code == 200:  # not pruned yet: both events still there
            assert [json.loads(i["body"])["data"]["n"] for i in answer.json()["items"]] == [0, 1]
        else:
            assert answer.status_code == 410


async def test_a_pull_only_endpoint_gets_no_post_from_tests_or_replays(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
) -> None:
    created = add_endpoint(engine, box, "https://gone.example/x", "*")
    with engine.begin() as conn:
        publish(conn, "order.created", {"n": 1})
    await Relay(async_engine, clock).run_until_idle()
    with engine.begin() as conn:
        conn.execute(text("UPDATE deliveries SET state = 'dead', completed_at = now()"))
        set_delivery_mode(conn, created.endpoint.uid, "pull", actor="test")
    dead = int(scalar(engine, "SELECT id FROM deliveries"))
    with engine.begin() as conn, pytest.raises(EndpointError, match="pull-only"):
        replay(conn, [dead], actor="test", reason="r", now=clock.now())
    with engine.begin() as conn, pytest.raises(EndpointError, match="pull-only"):
        send_test_event(conn, created.endpoint.uid, now=clock.now(), actor="test")
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 1


async def test_the_partners_openapi_document_describes_the_feed(
    engine: Engine, api: httpx.AsyncClient
) -> None:
    """Generated from the very route the server dispatches, so parameters cannot drift."""
    with engine.begin() as conn:
        _, viewer = create_token(conn, name="docs", role="viewer", actor="test")
    answer = await api.get(
        "/v1/contract/openapi.json", headers={"authorization": f"Bearer {viewer}"}
    )
    document = answer.json()
    validate(document)
    spec = document["paths"]["/feed/v1/{endpoint}"]["get"]
    assert {(p["in"], p["name"]) for p in spec["parameters"]} == {
        ("path", "endpoint"),
        ("query", "after"),
        ("query", "limit"),
    }
    assert spec["security"] == [{"feedToken": []}]
    assert {"200", "400", "401", "404", "410"} <= set(spec["responses"])
    assert document["components"]["securitySchemes"]["feedToken"]["scheme"] == "bearer"
    assert "webhooks" in document  # the event types are still there


async def test_feed_positions_follow_commit_order_across_concurrent_relays(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
) -> None:
    """A relay whose pass is still open holds the feed's row: a second relay appending to
    the same feed waits for its commit and numbers after it, so a reader never sees
    position 2 while position 1 may still appear."""
    created = add_endpoint(engine, box, "https://pull.example/x", "*", delivery_mode="pull")
    with engine.begin() as conn:
        publish(conn, "order.created", {"n": 1})
    params = {
        "limit": 10,
        "now": clock.now(),
        "max_attempts": 8,
        "rule_patterns": [],
        "rule_max_attempts": [],
    }
    first = engine.connect()
    first_pass = first.begin()
    first.execute(RELAY_BATCH, params)  # appended, not committed
    with engine.begin() as conn:
        publish(conn, "order.created", {"n": 2})
    second = asyncio.create_task(Relay(async_engine, clock).run_once())
    deadline = time.monotonic() + 20
    while not scalar(
        engine,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'",
    ):
        assert time.monotonic() < deadline, "the second relay never waited for the first"
        assert not second.done(), second
        await asyncio.sleep(0.01)
    assert scalar(engine, "SELECT count(*) FROM feed_entries") == 0  # nothing visible yet
    first_pass.commit()
    first.close()
    assert (await second).fed == 1
    order = rows(
        engine,
        "SELECT f.position, o.payload FROM feed_entries f JOIN outbox_events o "
        "ON o.id = f.event_id WHERE f.endpoint_id = (SELECT id FROM endpoints WHERE uid = :u) "
        "ORDER BY f.position",
        u=created.endpoint.uid,
    )
    assert [(r["position"], r["payload"]) for r in order] == [(1, {"n": 1}), (2, {"n": 2})]
