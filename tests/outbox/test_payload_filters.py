"""Payload filters (outbox/filters.py): evaluated by the relay in SQL for filtered endpoints
only; an event a filter cannot evaluate is skipped for that endpoint and counted, and no
filter, however hostile, stops the relay."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.endpoints import get_endpoint, list_endpoints
from outbox.errors import EndpointError, EndpointNotFoundError
from outbox.feeds import set_payload_filter
from outbox.filters import MAX_FILTER_LENGTH, validate_filter
from outbox.relay import Capacity, Relay, RelayConfig
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, rows

EUR_100 = '$.amount >= 100 && $.currency == "EUR"'


class _Taker:
    """The relay's handoff as the local worker: takes what it is handed, sends nothing."""

    def __init__(self, clock: ManualClock) -> None:
        self.capacity = Capacity(
            limit=100,
            worker_id="w-test",
            lease_expires_at=clock.now() + dt.timedelta(seconds=60),
            endpoint_slots=100,
            slots_left={},
        )
        self.taken: list[Any] = []

    async def settle(self) -> None:
        return None

    def reserve(self) -> Capacity | None:
        return self.capacity

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        self.taken.extend(rows)


def _received(engine: Engine, uid: str) -> list[object]:
    """The payloads fanned out to an endpoint, in event order."""
    return [
        r["payload"]
        for r in rows(
            engine,
            "SELECT o.payload FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id "
            "JOIN outbox_events o ON o.id = d.event_id WHERE e.uid = :uid ORDER BY o.id",
            uid=uid,
        )
    ]


@pytest.mark.parametrize("handoff", [False, True], ids=["batch", "handoff"])
async def test_matching_non_matching_erroring_and_unfiltered_endpoints(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    handoff: bool,
) -> None:
    filtered = add_endpoint(engine, box, "https://f.example/x", "*", payload_filter=EUR_100)
    everything = add_endpoint(engine, box, "https://all.example/x", "*")
    payloads = [
        {"amount": 150, "currency": "EUR"},  # matches
        {"amount": 50, "currency": "EUR"},  # does not
        {"amount": 150, "currency": "USD"},  # does not
        {"currency": "EUR"},  # no amount: false, not an error
        {"amount": "lots", "currency": "EUR"},  # a string compared with a number: error
        {"amount": 100, "currency": "EUR"},  # matches
    ]
    with engine.begin() as conn:
        for payload in payloads:
            publish(conn, "order.created", payload)
    pulled = add_endpoint(
        engine, box, "https://p.example/x", "*", payload_filter=EUR_100, delivery_mode="pull"
    )
    taker = _Taker(clock) if handoff else None
    result = await Relay(async_engine, clock, RelayConfig(), handoff=taker).run_once()
    assert (result.events, result.skipped, result.fed) == (6, 2, 2)
    if taker is not None:  # the local worker was handed what it could take, never a pull
        assert result.handed_off == result.deliveries == 8
        assert {row.endpoint_uid for row in taker.taken} == {
            filtered.endpoint.uid,
            everything.endpoint.uid,
        }
    assert _received(engine, pulled.endpoint.uid) == []  # its feed has them
    fed = rows(
        engine,
        "SELECT o.payload FROM feed_entries f JOIN outbox_events o ON o.id = f.event_id "
        "ORDER BY f.position",
    )
    assert [r["payload"] for r in fed] == [payloads[0], payloads[5]]
    assert _received(engine, filtered.endpoint.uid) == [payloads[0], payloads[5]]
    assert _received(engine, everything.endpoint.uid) == payloads
    # The error is counted on the endpoint and kept with its event.
    with engine.connect() as conn:
        assert get_endpoint(conn, filtered.endpoint.uid).filter_skips == 1
        assert get_endpoint(conn, everything.endpoint.uid).filter_skips == 0
    skipped = rows(
        engine,
        "SELECT o.payload FROM filter_skips s JOIN outbox_events o ON o.id = s.event_id",
    )
    assert [r["payload"] for r in skipped] == [payloads[4], payloads[4]]


async def test_a_filter_no_check_could_catch_still_never_stops_the_relay(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock, box: SecretBox
) -> None:
    """Filters written into the table by hand, past every check: a variable (raises even
    in silent mode), a date compared without a zone, and junk that is no path at all.
    Each event is skipped for them and counted; the other endpoint gets everything."""
    hand_written = {
        "variable": "$.amount > $limit",
        "datetime": '$.at.datetime() < "2026-01-01".datetime()',
        "junk": "this is not a path (",
        "deep": "!(" * 330 + "$.amount == 5" + ")" * 330,  # an even number of nots
    }
    uids = {}
    for name, expression in hand_written.items():
        uids[name] = add_endpoint(engine, box, f"https://{name}.example/x", "*").endpoint.uid
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE endpoints SET payload_filter = :f WHERE uid = :uid"),
                {"f": expression, "uid": uids[name]},
            )
    plain = add_endpoint(engine, box, "https://plain.example/x", "*").endpoint.uid
    with engine.begin() as conn:
        publish(conn, "order.created", {"amount": 5, "at": "2026-02-01T10:00:00+01:00"})
        publish(conn, "order.created", {"amount": 7, "at": "2025-02-01"})
    result = await Relay(async_engine, clock).run_until_idle()
    assert result.events == 2
    assert len(_received(engine, plain)) == 2
    with engine.connect() as conn:
        counts = {e.uid: (e.filter_skips, e.payload_filter) for e in list_endpoints(conn)}
    for name in ("variable", "junk"):
        assert counts[uids[name]][0] == 2, name
    # With the zone-aware comparison a date with and without a zone compares (no error).
    assert _received(engine, uids["datetime"]) == [{"amount": 7, "at": "2025-02-01"}]
    assert _received(engine, uids["deep"]) == [{"amount": 5, "at": "2026-02-01T10:00:00+01:00"}]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("$.amount >", "not a valid SQL/JSON path: syntax error"),
        ('$.amount >= 100 && $.currency = "EUR"', "not a valid SQL/JSON path"),
        ("$.amount", "is a path, not a predicate"),
        ("$.amount > $limit", "uses a variable"),
        ('$.name like_regex "^(a+)+$"', "like_regex is not allowed"),
        ('$.name like_regex "(.*){1,200}b" flag "i"', "like_regex is not allowed"),
        ("$.a == 1" + " && $.a == 1" * 200, f"at most {MAX_FILTER_LENGTH}"),
        ("$.a == \x00", "NUL"),
    ],
)
def test_invalid_or_hostile_filters_are_refused_with_a_reason(
    engine: Engine, box: SecretBox, expression: str, message: str
) -> None:
    created = add_endpoint(engine, box, "https://f.example/x", "*")
    with engine.begin() as conn, pytest.raises(EndpointError, match=message.replace("$", r"\$")):
        set_payload_filter(conn, created.endpoint.uid, expression, actor="test")
    with engine.begin() as conn, pytest.raises(EndpointError, match=message.replace("$", r"\$")):
        add_endpoint(engine, box, "https://g.example/x", "*", payload_filter=expression)
        del conn


def test_accepted_filters_are_stored_as_written_and_blank_clears(engine: Engine) -> None:
    with engine.begin() as conn:
        for expression in (
            EUR_100,
            'exists($.refund) || $.tags[*] == "vip"',
            '$.customer.country starts with "D"',
            "!($.amount < 0)",
            "$.paid == true",
            '$.at.datetime() >= "2026-01-01".datetime()',
            "strict $.amount > 0",
            # As deep as the size cap allows: PostgreSQL's parser takes it.
            "(" * 496 + "$.a == 1" + ")" * 496,
            "!(" * 330 + "$.a == 1" + ")" * 330,
        ):
            assert validate_filter(conn, f"  {expression} ") == expression
        assert validate_filter(conn, "   ") is None
        assert validate_filter(conn, None) is None


def test_the_filter_is_scoped_to_the_callers_tenant(engine: Engine, box: SecretBox) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "seller-a")
        create_tenant(conn, "seller-b")
    theirs = add_endpoint(engine, box, "https://b.example/x", "*", tenant="seller-b")
    with engine.begin() as conn, pytest.raises(EndpointNotFoundError):
        set_payload_filter(conn, theirs.endpoint.uid, "$.a == 1", actor="test", scope="seller-a")
    with engine.connect() as conn:
        assert get_endpoint(conn, theirs.endpoint.uid).payload_filter is None
    with engine.begin() as conn:
        set_payload_filter(conn, theirs.endpoint.uid, "$.a == 1", actor="test", scope="seller-b")
    with engine.connect() as conn:
        assert get_endpoint(conn, theirs.endpoint.uid).payload_filter == "$.a == 1"
        audit = conn.execute(
            text("SELECT details FROM audit_log WHERE action = 'endpoint.payload_filter'")
        ).scalar_one()
    assert audit == {"payload_filter": "$.a == 1", "before": None}


def test_like_regex_is_refused_because_one_pattern_takes_seconds_per_event(
    engine: Engine,
) -> None:
    """The measurement behind refusing like_regex: PostgreSQL's regex engine spends
    about a second (1.35 s on the bench machine) on one 5,000-character string for this
    pattern; the relay would pay it per event and per endpoint."""
    with engine.connect() as conn:
        started = time.perf_counter()
        conn.execute(
            text(
                "SELECT jsonb_path_match(jsonb_build_object('s', repeat('a', 3000)), "
                "'$.s like_regex \"(.*){1,200}b\"', '{}', true)"
            )
        )
        spent = time.perf_counter() - started
    assert spent > 0.1, f"{spent:.3f}s: the pattern is cheap here, revisit the refusal"


async def test_the_bench_row_relays_both_kinds_and_reports_both_rates(database_url: str) -> None:
    """bench/filters.py at a tiny size: every event reaches every endpoint of its kind."""
    from bench.filters import FilterPlan, filter_rates, report

    plan = FilterPlan(endpoints=5, events_per_round=3, rounds=1, batch_size=2)
    result = await filter_rates(database_url, plan)
    assert result["plain"]["delivery_rows_per_s"] > 0
    assert result["filtered"]["delivery_rows_per_s"] > 0
    assert "unfiltered:" in report(result) and "filtered:" in report(result)


async def test_the_admin_api_validates_and_shows_the_filter(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    import httpx

    from delivery.operator.api import create_app
    from outbox.tokens import create_token

    with engine.begin() as conn:
        _, secret = create_token(conn, name="ops", role="operator", actor="test")
    auth = {"authorization": f"Bearer {secret}"}
    app = create_app(async_engine, box, clock=clock)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        base = {"url": "https://f.example/x", "event_types": "*"}
        bad = await http.post(
            "/v1/endpoints", json={**base, "payload_filter": "$.a >"}, headers=auth
        )
        assert bad.status_code == 400
        assert "not a valid SQL/JSON path: syntax error" in bad.json()["error"]
        huge = await http.post(
            "/v1/endpoints", json={**base, "payload_filter": "$.a == 1" * 200}, headers=auth
        )
        assert huge.status_code == 400 and "1000" in huge.text
        assert rows(engine, "SELECT uid FROM endpoints") == []  # nothing half-made
        made = await http.post(
            "/v1/endpoints", json={**base, "payload_filter": EUR_100}, headers=auth
        )
        assert made.status_code == 200 and made.json()["payload_filter"] == EUR_100
        uid = made.json()["id"]
        cleared = await http.patch(
            f"/v1/endpoints/{uid}", json={"payload_filter": None}, headers=auth
        )
        assert cleared.status_code == 200, cleared.text
        assert cleared.json()["payload_filter"] is None and cleared.json()["filter_skips"] == 0
        refused = await http.patch(
            f"/v1/endpoints/{uid}", json={"payload_filter": '$.a like_regex "x"'}, headers=auth
        )
        assert refused.status_code == 400 and "like_regex" in refused.json()["error"]
