"""Hostile schemas (issue 29): no schema reaches the network or the disk, catastrophic
patterns cannot hang publish(), the relay or the admin server, schemas are capped, and
the payload limits mean what their settings say. Every attack is made through each door
it had: the CLI, the admin API, publish() and the SQL function with the relay."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socketserver
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import AdminConfig, create_app, serve
from delivery.operator.cli import main
from outbox import PublishError, publish
from outbox.catalogue import CACHE, add_event_type, validate_pending
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine
from outbox.errors import CatalogueError, ConfigurationError
from outbox.relay import Relay, RelayConfig
from outbox.schema_rules import SchemaLimits, compile_schema
from outbox.settings import load_settings
from outbox.tokens import create_token
from tests.helpers import rows, scalar

REDOS_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
REDOS_PAYLOAD = {"s": "a" * 30 + "!"}


def laughs(levels: int = 40) -> dict[str, object]:
    """A few hundred bytes that ask for 2**levels evaluations of one keyword."""
    defs: dict[str, object] = {"d0": {"type": "integer"}}
    for i in range(1, levels):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {
        "type": "object",
        "$defs": defs,
        "properties": {"n": {"$ref": f"#/$defs/d{levels - 1}"}},
    }


class _Counting(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server = self.server
        assert isinstance(server, CountingServer)
        server.connections += 1
        self.request.recv(65536)
        body = json.dumps({"enum": [server.marker]}).encode()
        self.request.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )


class CountingServer(socketserver.ThreadingTCPServer):
    """A real HTTP server on 127.0.0.1 that counts every connection made to it and would
    serve a schema with a unique marker: neither may ever be seen."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Counting)
        self.connections = 0
        self.marker = f"REMOTE-{uuid.uuid4().hex}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/schema.json"


@pytest.fixture
def remote() -> Iterator[CountingServer]:
    server = CountingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def local_file(tmp_path: Path) -> tuple[str, str]:
    """A JSON file a `file://` reference names, holding a marker that must never show up."""
    marker = f"LOCAL-{uuid.uuid4().hex}"
    path = tmp_path / "secret.json"
    path.write_text(json.dumps({"enum": [marker]}))
    return path.as_uri(), marker


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    monkeypatch.delenv("OUTBOX_EVENT_TYPES", raising=False)
    return CliRunner()


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    CACHE.clear()
    yield
    CACHE.clear()


def invoke(cli: CliRunner, *args: str) -> Result:
    return cli.invoke(main, list(args), catch_exceptions=False)


def add_via_cli(
    cli: CliRunner, tmp_path: Path, name: str, schema: object, example: object
) -> Result:
    schema_file, example_file = tmp_path / f"{name}.schema.json", tmp_path / f"{name}.ex.json"
    schema_file.write_text(json.dumps(schema))
    example_file.write_text(json.dumps(example))
    return invoke(
        cli,
        "event-types",
        "add",
        name,
        "--schema",
        str(schema_file),
        "--example",
        str(example_file),
    )


def store_unchecked(engine: Engine, name: str, schema: object) -> None:
    """A schema stored before the rules existed (or by hand): written straight to the table."""
    with engine.begin() as conn:
        type_id = conn.execute(
            text("INSERT INTO event_types (name) VALUES (:name) RETURNING id"), {"name": name}
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO event_type_versions (event_type_id, version, schema)"
                " VALUES (:id, 1, CAST(:schema AS jsonb))"
            ),
            {"id": type_id, "schema": json.dumps(schema)},
        )


def ref_schema(ref: str) -> dict[str, object]:
    return {"type": "object", "properties": {"x": {"$ref": ref}}}


# -- 1. references: nothing is fetched or read ---------------------------------------------


def test_cli_refuses_remote_and_file_references_and_fetches_nothing(
    cli: CliRunner, tmp_path: Path, remote: CountingServer, local_file: tuple[str, str]
) -> None:
    file_uri, marker = local_file
    for ref in (remote.url, file_uri, "other.json", "https://169.254.169.254/latest"):
        result = add_via_cli(cli, tmp_path, "order.created", ref_schema(ref), {"x": "y"})
        assert result.exit_code != 0
        assert f"$ref {ref!r} at $.properties.x leaves the schema" in result.output
        assert marker not in result.output and remote.marker not in result.output
    assert remote.connections == 0


async def test_api_refuses_remote_and_file_references_with_400(
    engine: Engine,
    api: httpx.AsyncClient,
    remote: CountingServer,
    local_file: tuple[str, str],
) -> None:
    file_uri, marker = local_file
    headers = operator(engine)
    for ref in (remote.url, file_uri, "http://127.0.0.1:9/unreachable.json"):
        answer = await api.post(
            "/v1/event-types",
            json={"name": "order.created", "schema": ref_schema(ref), "example": {"x": "y"}},
            headers=headers,
        )
        assert answer.status_code == 400, answer.text
        assert "leaves the schema" in answer.json()["error"]
        assert marker not in answer.text and remote.marker not in answer.text
    dynamic = await api.post(
        "/v1/event-types",
        json={"name": "order.created", "schema": {"$dynamicRef": file_uri}},
        headers=headers,
    )
    assert dynamic.status_code == 400 and "$dynamicRef" in dynamic.json()["error"]
    named = await api.post(
        "/v1/event-types",
        json={"name": "order.created", "schema": {"$id": remote.url, "$ref": "x.json"}},
        headers=headers,
    )
    assert named.status_code == 400 and "$id" in named.json()["error"]
    assert remote.connections == 0


def test_publish_with_a_stored_remote_reference_raises_publish_error_and_fetches_nothing(
    engine: Engine, remote: CountingServer, local_file: tuple[str, str]
) -> None:
    file_uri, marker = local_file
    store_unchecked(engine, "legacy.remote", ref_schema(remote.url))
    store_unchecked(engine, "legacy.file", ref_schema(file_uri))
    store_unchecked(engine, "legacy.gone", ref_schema("http://127.0.0.1:9/unreachable.json"))
    for name in ("legacy.remote", "legacy.file", "legacy.gone"):
        with engine.begin() as conn, pytest.raises(PublishError) as refused:
            publish(conn, name, {"x": "anything"})
        assert "breaks the catalogue's rules" in str(refused.value)
        assert marker not in str(refused.value) and remote.marker not in str(refused.value)
    assert remote.connections == 0
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0


async def test_sql_published_event_with_a_stored_remote_reference_is_rejected_alone(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    remote: CountingServer,
    local_file: tuple[str, str],
) -> None:
    file_uri, marker = local_file
    store_unchecked(engine, "legacy.remote", ref_schema(remote.url))
    store_unchecked(engine, "legacy.file", ref_schema(file_uri))
    with engine.begin() as conn:
        for event_type in ("legacy.remote", "order.created", "legacy.file"):
            conn.execute(
                text("SELECT outbox_publish(NULL, :type, CAST('{\"x\": 1}' AS jsonb))"),
                {"type": event_type},
            )
    result = await Relay(async_engine, clock).run_until_idle()
    assert result.rejected == 2
    events = rows(
        engine, "SELECT event_type, relayed_at IS NOT NULL AS relayed, rejected_reason"
        " FROM outbox_events ORDER BY id",
    )  # fmt: skip
    assert [e["relayed"] for e in events] == [True, True, True]
    assert events[1]["rejected_reason"] is None
    for event in (events[0], events[2]):
        assert "breaks the catalogue's rules" in event["rejected_reason"]
        assert marker not in event["rejected_reason"]
        assert remote.marker not in event["rejected_reason"]
    assert remote.connections == 0


def test_catalogue_references_are_pinned_versions_bundled_into_the_schema(engine: Engine) -> None:
    address = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    with engine.begin() as conn:
        add_event_type(conn, "address.changed", schema=address, actor="test")
        order = add_event_type(
            conn,
            "order.created",
            schema={
                "type": "object",
                "properties": {"ship_to": {"$ref": "urn:outbox:event-type:address.changed:1"}},
            },
            actor="test",
        )
        with pytest.raises(CatalogueError, match="names no catalogued schema"):
            add_event_type(
                conn,
                "order.cancelled",
                schema={"$ref": "urn:outbox:event-type:address.changed:2"},
                actor="test",
            )
    bundled = order.schema["$defs"]["urn:outbox:event-type:address.changed:1"]
    assert bundled == {"$id": "urn:outbox:event-type:address.changed:1", **address}
    with engine.begin() as conn:
        publish(conn, "order.created", {"ship_to": {"city": "Lyon"}})
        with pytest.raises(PublishError, match="'city' is a required property"):
            publish(conn, "order.created", {"ship_to": {}})


# -- 2. patterns, caps and the time budget --------------------------------------------------


def test_patterns_re2_cannot_run_are_refused_naming_the_reason(
    cli: CliRunner, tmp_path: Path
) -> None:
    for pattern, reason in (("(a)\\1", "invalid escape sequence"), ("(?=a)b", "(?=")):
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
        result = add_via_cli(cli, tmp_path, "order.created", schema, {"s": "b"})
        assert result.exit_code != 0
        assert "cannot run on the linear-time regex engine" in result.output
        assert reason in result.output


def test_redos_pattern_through_publish_is_answered_at_once(engine: Engine) -> None:
    with engine.begin() as conn:
        add_event_type(conn, "order.created", schema=REDOS_SCHEMA, actor="test")
    started = time.perf_counter()
    with engine.begin() as conn, pytest.raises(PublishError, match="does not match"):
        publish(conn, "order.created", REDOS_PAYLOAD)
    assert time.perf_counter() - started < 1.0  # it used to take over 60 s
    with engine.begin() as conn:
        publish(conn, "order.created", {"s": "aaaa"})


async def test_redos_and_budget_busting_rows_do_not_hold_the_relay_batch(
    engine: Engine, async_engine: AsyncEngine, clock: ManualClock
) -> None:
    with engine.begin() as conn:
        add_event_type(conn, "order.created", schema=REDOS_SCHEMA, actor="test")
        add_event_type(conn, "order.counted", schema=laughs(), actor="test")
        for event_type, payload in [
            ("order.created", REDOS_PAYLOAD),
            ("order.counted", {"n": 1}),
            ("order.created", {"s": "aaa"}),
            ("invoice.paid", {"id": 1}),
        ]:
            conn.execute(
                text("SELECT outbox_publish(NULL, :type, CAST(:payload AS jsonb))"),
                {"type": event_type, "payload": json.dumps(payload)},
            )
    relay = Relay(async_engine, clock, RelayConfig(validation_budget=0.05))
    started = time.perf_counter()
    result = await relay.run_until_idle()
    assert time.perf_counter() - started < 5.0
    assert result.rejected == 2
    events = rows(
        engine, "SELECT relayed_at IS NOT NULL AS relayed, rejected_reason FROM outbox_events"
        " ORDER BY id",
    )  # fmt: skip
    assert all(e["relayed"] for e in events)
    assert "does not match '^(a+)+$'" in events[0]["rejected_reason"]
    assert "longer than its 50 ms budget" in events[1]["rejected_reason"]
    assert events[2]["rejected_reason"] is None and events[3]["rejected_reason"] is None


def test_budget_is_checked_between_keywords_with_an_injected_timer() -> None:
    ticks = iter(range(1_000_000))
    compiled = compile_schema(laughs(20))
    problem = compiled.problem({"n": 1}, budget=50, timer=lambda: float(next(ticks)))
    assert problem is not None and "budget" in problem
    assert compile_schema(laughs(8)).problem({"n": 1}, budget=10.0) is None


def test_publish_refuses_a_payload_over_the_validation_budget(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_VALIDATION_BUDGET_MS", "30")
    with engine.begin() as conn:
        add_event_type(conn, "order.counted", schema=laughs(), actor="test")
    started = time.perf_counter()
    with engine.begin() as conn, pytest.raises(PublishError, match="30 ms budget"):
        publish(conn, "order.counted", {"n": 1})
    assert time.perf_counter() - started < 2.0
    monkeypatch.setenv("OUTBOX_VALIDATION_BUDGET_MS", "0")
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="from 1 to"):
        publish(conn, "order.counted", {"n": 1})


def test_a_5_mb_schema_is_refused_fast(cli: CliRunner, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(170_000)}}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(schema))
    assert path.stat().st_size > 5_000_000
    started = time.perf_counter()
    result = invoke(cli, "event-types", "add", "order.created", "--schema", str(path))
    assert time.perf_counter() - started < 3.0  # it used to take 16 s and 227 MB
    assert result.exit_code != 0 and "over the 262144-byte limit" in result.output


def test_depth_and_keyword_caps_are_settings(cli: CliRunner, tmp_path: Path) -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(10):
        deep = {"type": "object", "properties": {"a": deep}}
    limits = SchemaLimits(max_depth=8)
    with pytest.raises(CatalogueError, match="deeper than 8 levels"):
        from outbox.schema_rules import vet_schema

        vet_schema(deep, limits)
    result = add_via_cli(cli, tmp_path, "order.deep", deep, {})
    assert result.exit_code == 0, result.output  # 21 levels: within the default 32
    cli.env = {"OUTBOX_MAX_SCHEMA_DEPTH": "8"}
    refused = add_via_cli(cli, tmp_path, "order.deeper", deep, {})
    assert refused.exit_code != 0 and "raise OUTBOX_MAX_SCHEMA_DEPTH" in refused.output
    cli.env = {"OUTBOX_MAX_SCHEMA_KEYWORDS": "10"}
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(12)}}
    refused = add_via_cli(cli, tmp_path, "order.wide", wide, {})
    assert refused.exit_code != 0 and "more than 10 keywords" in refused.output


def test_schema_settings_are_validated() -> None:
    settings = load_settings()
    assert (settings.max_schema_bytes, settings.max_schema_depth) == (262144, 32)
    assert (settings.max_schema_keywords, settings.validation_budget_ms) == (10_000, 100.0)
    with pytest.raises(ConfigurationError, match="OUTBOX_VALIDATION_BUDGET_MS"):
        load_settings(validation_budget_ms=0)
    with pytest.raises(ConfigurationError, match="OUTBOX_MAX_SCHEMA_DEPTH"):
        load_settings(max_schema_depth=1000)


# -- the admin server validates off its event loop -------------------------------------------


@pytest.fixture
async def api(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        yield http


def operator(engine: Engine) -> dict[str, str]:
    with engine.begin() as conn:
        _, secret = create_token(conn, name="operator", role="operator", actor="test")
    return {"authorization": f"Bearer {secret}"}


@contextlib.contextmanager
def admin_server_in_its_own_thread(database_url: str, box: SecretBox) -> Iterator[str]:
    """`outbox serve`'s app on 127.0.0.1 with its own event loop in its own thread, as in
    production: a stall of that loop shows up as latency to a client (the test) outside it.
    A 2 s validation budget: four schemas that use it all would hold a loop for 8 s."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def run() -> None:
        engine = make_async_engine(database_url)
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        app = create_app(engine, box, config=AdminConfig(validation_budget=2.0))

        def on_started(port: int) -> None:
            state["port"] = port
            ready.set()

        try:
            await serve(app, host="127.0.0.1", port=0, stop=state["stop"], on_started=on_started)
        finally:
            await engine.dispose()

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    assert ready.wait(timeout=15), "the admin server did not start"
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(timeout=60)


async def test_healthz_answers_while_four_hostile_schemas_are_submitted(
    engine: Engine, database_url: str, box: SecretBox
) -> None:
    headers = operator(engine)
    hostile = [
        {"name": f"order.redos{i}", "schema": REDOS_SCHEMA, "example": REDOS_PAYLOAD}
        for i in range(2)
    ] + [{"name": f"order.laughs{i}", "schema": laughs(), "example": {"n": 1}} for i in range(2)]
    with admin_server_in_its_own_thread(database_url, box) as base:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            posts = [
                asyncio.create_task(http.post(f"{base}/v1/event-types", json=body, headers=headers))
                for body in hostile
            ]
            # /healthz again and again until every submission is answered: each within 1 s.
            slowest, checks = 0.0, 0
            while not all(post.done() for post in posts):
                health_started = time.perf_counter()
                health = await asyncio.wait_for(http.get(f"{base}/healthz"), timeout=5.0)
                assert health.status_code == 200
                slowest = max(slowest, time.perf_counter() - health_started)
                checks += 1
                await asyncio.sleep(0.02)
            answers = await asyncio.gather(*posts)
    assert checks >= 5 and slowest < 1.0, (checks, slowest)
    assert [a.status_code for a in answers] == [400, 400, 400, 400]
    assert "does not match" in answers[0].json()["error"]
    assert "2000 ms budget" in answers[2].json()["error"]


# -- 5. settings that do what they say -------------------------------------------------------


def nested(levels: int) -> dict[str, object]:
    inner: object = 1
    for _ in range(levels - 1):
        inner = [inner]
    return {"d": inner}


def test_publish_follows_outbox_max_payload_depth_and_bytes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_DEPTH", "3")
    with engine.begin() as conn:
        publish(conn, "order.created", nested(3))
        with pytest.raises(PublishError, match="deeper than 3 levels"):
            publish(conn, "order.created", nested(4))
        publish(conn, "order.created", nested(4), max_payload_depth=4)  # the caller's wins
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_DEPTH", "100")
    with engine.begin() as conn:
        publish(conn, "order.created", nested(80))  # over the default 64, within the setting
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_BYTES", "20")
    with engine.begin() as conn, pytest.raises(PublishError, match="over the 20-byte limit"):
        publish(conn, "order.created", {"text": "x" * 20})
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_DEPTH", "257")
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="from 1 to 256"):
        publish(conn, "order.created", {})


SQL_LIMITS = text(
    "SELECT outbox_publish(NULL, 'order.created', CAST(:payload AS jsonb), NULL, NULL, NULL,"
    " :max_bytes, :max_depth)"
)


def test_sql_null_limits_are_the_defaults_and_the_ceilings_hold(engine: Engine) -> None:
    big = json.dumps({"text": "x" * 70_000})
    for max_bytes, max_depth, message in [
        (None, None, "over the 65536-byte limit"),
        (2_000_000, None, "max_payload_bytes 2000000 is outside 1..1048576"),
        (None, 300, "max_payload_depth 300 is outside 1..256"),
    ]:
        with engine.begin() as conn, pytest.raises(DBAPIError, match=message):
            conn.execute(
                SQL_LIMITS, {"payload": big, "max_bytes": max_bytes, "max_depth": max_depth}
            )
    with engine.begin() as conn:
        conn.execute(SQL_LIMITS, {"payload": big, "max_bytes": 100_000, "max_depth": None})
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1


def test_a_stored_schema_with_a_root_id_and_dialect_keeps_validating(engine: Engine) -> None:
    """Schemas stored before the rules were always validated as Draft 2020-12 with their
    root `$id` only naming them: they keep working (local references resolve), while a new
    schema with a `$id` is refused when added."""
    legacy = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": "https://example.com/order.json",
        "type": "object",
        "required": ["id"],
        "$defs": {"id": {"type": "integer"}},
        "properties": {"id": {"$ref": "#/$defs/id"}},
    }
    store_unchecked(engine, "order.created", legacy)
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
        with pytest.raises(PublishError, match="'x' is not of type 'integer'"):
            publish(conn, "order.created", {"id": "x"})
        with pytest.raises(CatalogueError, match="only Draft 2020-12"):
            add_event_type(conn, "order.updated", schema=legacy, actor="test")
        without_dialect = {k: v for k, v in legacy.items() if k != "$schema"}
        with pytest.raises(CatalogueError, match="remove \\$id"):
            add_event_type(conn, "order.updated", schema=without_dialect, actor="test")


def test_one_relay_pass_validates_for_at_most_ten_budgets_and_leaves_the_rest_pending(
    engine: Engine, clock: ManualClock
) -> None:
    """Many budget-busting rows cannot hold a pass either: it stops taking new rows after
    PASS_BUDGETS budgets (time from an injected timer), the rest wait for the next pass."""
    with engine.begin() as conn:
        add_event_type(conn, "order.counted", schema=laughs(), actor="test")
        for _ in range(30):
            conn.execute(text("SELECT outbox_publish(NULL, 'order.counted', '{\"n\": 1}')"))
    ticks = iter(range(10_000_000))
    with engine.begin() as conn:
        rejected = validate_pending(
            conn,
            now=clock.now(),
            mode="accept",
            limit=500,
            budget=100.0,
            timer=lambda: float(next(ticks)),
        )
    assert 10 <= rejected <= 11  # each row spends one budget (100 ticks) of the 1000
    pending = scalar(engine, "SELECT count(*) FROM outbox_events WHERE validate_pending")
    assert pending == 30 - rejected
    reasons = rows(engine, "SELECT DISTINCT rejected_reason FROM outbox_events"
                   " WHERE rejected_at IS NOT NULL")  # fmt: skip
    assert len(reasons) == 1 and "100000 ms budget" in reasons[0]["rejected_reason"]
