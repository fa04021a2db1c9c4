"""The event-type catalogue through the CLI, the admin API and publish(): versioned schemas,
validation naming the JSON path and rule, strict mode, and the generated OpenAPI document."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psycopg
import pytest
from click.testing import CliRunner, Result
from openapi_spec_validator import validate
from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.api import create_app
from delivery.operator.cli import main
from outbox import PublishError, publish, publish_async
from outbox.catalogue import CACHE, OPERATIONAL_EVENT_TYPES, update_event_type
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import libpq_url, make_engine
from outbox.tokens import create_token
from tests.helpers import rows, scalar

ORDER_SCHEMA = {
    "type": "object",
    "required": ["id", "total"],
    "properties": {
        "id": {"type": "string"},
        "total": {"type": "number", "minimum": 0},
        "items": {
            "type": "array",
            "items": {"type": "object", "required": ["sku"], "properties": {"sku": {}}},
        },
    },
}
EXAMPLE = {"id": "ord_1", "total": 12.5, "items": [{"sku": "A-1"}]}


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    monkeypatch.delenv("OUTBOX_EVENT_TYPES", raising=False)
    return CliRunner()


def invoke(cli: CliRunner, *args: str) -> Result:
    return cli.invoke(main, list(args), catch_exceptions=False)


def write(tmp_path: Path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def add_order_type(cli: CliRunner, tmp_path: Path) -> None:
    result = invoke(
        cli,
        "event-types",
        "add",
        "order.created",
        "--schema",
        write(tmp_path, "schema.json", ORDER_SCHEMA),
        "--example",
        write(tmp_path, "example.json", EXAMPLE),
        "--description",
        "An order was placed.",
    )
    assert result.exit_code == 0, result.output


def test_cli_lifecycle_versions_stay_readable(
    cli: CliRunner, engine: Engine, tmp_path: Path
) -> None:
    add_order_type(cli, tmp_path)
    listed = json.loads(invoke(cli, "event-types", "list", "--json").output)
    assert [(t["name"], t["status"], t["version"]) for t in listed] == [
        ("order.created", "active", 1)
    ]
    v2 = {**ORDER_SCHEMA, "required": ["id", "total", "currency"]}
    updated = invoke(
        cli,
        "event-types",
        "update",
        "order.created",
        "--schema",
        write(tmp_path, "v2.json", v2),
        "--example",
        write(tmp_path, "ex2.json", {**EXAMPLE, "currency": "EUR"}),
        "--json",
    )
    assert updated.exit_code == 0, updated.output
    assert json.loads(updated.output)["version"] == 2
    shown = json.loads(invoke(cli, "event-types", "show", "order.created", "--json").output)
    assert shown["versions"] == [1, 2] and shown["schema"] == v2
    old = json.loads(
        invoke(cli, "event-types", "show", "order.created", "--version", "1", "--json").output
    )
    assert old["schema"] == ORDER_SCHEMA
    assert "deprecated" in invoke(cli, "event-types", "deprecate", "order.created").output
    assert "archived" in invoke(cli, "event-types", "archive", "order.created").output
    with engine.begin() as conn, pytest.raises(PublishError, match="archived"):
        publish(conn, "order.created", {**EXAMPLE, "currency": "EUR"})
    actions = [r["action"] for r in rows(engine, "SELECT action FROM audit_log ORDER BY id")]
    assert actions == ["event_type.add"] + ["event_type.update"] * 3


def test_invalid_schema_and_mismatching_example_are_refused_and_write_nothing(
    cli: CliRunner, engine: Engine, tmp_path: Path
) -> None:
    bad = invoke(
        cli,
        "event-types",
        "add",
        "order.created",
        "--schema",
        write(tmp_path, "bad.json", {"type": "object", "properties": {"id": {"type": "strin"}}}),
    )
    assert bad.exit_code == 1
    assert "not valid JSON Schema (Draft 2020-12) at $.properties.id.type" in bad.output
    not_json = invoke(cli, "event-types", "add", "a.b", "--schema", str(tmp_path / "missing.json"))
    assert not_json.exit_code == 1 and "cannot read the schema file" in not_json.output
    wrong_example = invoke(
        cli,
        "event-types",
        "add",
        "order.created",
        "--schema",
        write(tmp_path, "s.json", ORDER_SCHEMA),
        "--example",
        write(tmp_path, "e.json", {"id": "x", "total": -1}),
    )
    assert wrong_example.exit_code == 1
    assert "example does not match the schema at $.total" in wrong_example.output
    reserved = invoke(
        cli, "event-types", "add", "delivery.dead", "--schema", write(tmp_path, "r.json", {})
    )
    assert reserved.exit_code == 1 and "operational event" in reserved.output
    assert scalar(engine, "SELECT count(*) FROM event_types") == 0
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0


def test_publish_names_the_json_path_and_rule_and_writes_nothing(
    cli: CliRunner, engine: Engine, tmp_path: Path
) -> None:
    add_order_type(cli, tmp_path)
    with engine.begin() as conn:
        assert publish(conn, "order.created", EXAMPLE).startswith("msg_")
        with pytest.raises(PublishError) as missing:
            publish(conn, "order.created", {"id": "x"})
        assert "at $: 'total' is a required property (rule 'required')" in str(missing.value)
        with pytest.raises(PublishError) as nested:
            publish(conn, "order.created", {"id": "x", "total": 1, "items": [{"sku": 1}, {}]})
        assert "at $.items[1]" in str(nested.value) and "rule 'required'" in str(nested.value)
        with pytest.raises(PublishError, match=r"at \$.total: -3 is less than the minimum"):
            publish(conn, "order.created", {"id": "x", "total": -3})
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1


async def test_publish_async_validates_too(
    cli: CliRunner, async_engine: AsyncEngine, tmp_path: Path
) -> None:
    add_order_type(cli, tmp_path)
    async with async_engine.begin() as conn:
        with pytest.raises(PublishError, match="rule 'type'"):
            await publish_async(conn, "order.created", {"id": 5, "total": 1})
        assert (await publish_async(conn, "order.created", EXAMPLE)).startswith("msg_")


def test_strict_mode_refuses_unknown_types_default_accepts(
    cli: CliRunner, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_order_type(cli, tmp_path)
    with engine.begin() as conn:
        publish(conn, "invoice.paid", {"n": 1})  # default: accepted unchecked
    monkeypatch.setenv("OUTBOX_EVENT_TYPES", "strict")
    with engine.begin() as conn:
        with pytest.raises(PublishError, match="not in the catalogue and OUTBOX_EVENT_TYPES="):
            publish(conn, "invoice.paid", {"n": 1})
        publish(conn, "order.created", EXAMPLE)  # catalogued: fine
    monkeypatch.setenv("OUTBOX_EVENT_TYPES", "strickt")
    with engine.begin() as conn, pytest.raises(Exception, match="is not a mode"):
        publish(conn, "invoice.paid", {"n": 1})
    monkeypatch.delenv("OUTBOX_EVENT_TYPES")
    with engine.begin() as conn, pytest.raises(PublishError, match="not in the catalogue"):
        publish(conn, "invoice.paid", {"n": 1}, strict=True)
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 2


def require_currency(engine: Engine) -> None:
    """Someone else makes 'currency' required: a new revision of order.created."""
    stricter = {**ORDER_SCHEMA, "required": ["id", "total", "currency"]}
    with engine.begin() as conn:
        update_event_type(
            conn, "order.created", schema=stricter, example={**EXAMPLE, "currency": "X"},
            actor="elsewhere",
        )  # fmt: skip


def test_a_schema_change_made_elsewhere_is_seen_without_a_query_per_publish(
    cli: CliRunner, engine: Engine, database_url: str, tmp_path: Path
) -> None:
    """Another process (here: the CLI, then a second engine) changes the catalogue; the
    cached schema is noticed as stale inside publish's own INSERT and re-read."""
    add_order_type(cli, tmp_path)
    CACHE.clear()
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    with engine.begin() as conn:
        publish(conn, "order.created", EXAMPLE)
        publish(conn, "order.created", EXAMPLE)
    # One catalogue read for the first publish, then one statement per publish.
    assert len([s for s in statements if "event_type_versions" in s]) == 1
    assert len([s for s in statements if "INSERT INTO outbox_events" in s]) == 2

    other = make_engine(database_url)
    try:
        require_currency(other)
    finally:
        other.dispose()
    with engine.begin() as conn, pytest.raises(PublishError, match="'currency' is a required"):
        publish(conn, "order.created", EXAMPLE)
    event.remove(engine, "before_cursor_execute", count)


@pytest.fixture
async def api(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(async_engine, box, clock=clock)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        yield http


def bearer(engine: Engine, role: str) -> dict[str, str]:
    with engine.begin() as conn:
        _, secret = create_token(conn, name=role, role=role, actor="test")
    return {"authorization": f"Bearer {secret}"}


async def test_admin_api_catalogue_and_openapi_export(
    engine: Engine, api: httpx.AsyncClient
) -> None:
    operator, viewer = bearer(engine, "operator"), bearer(engine, "viewer")
    body = {"name": "order.created", "schema": ORDER_SCHEMA, "example": EXAMPLE,
            "description": "An order was placed."}  # fmt: skip
    assert (await api.post("/v1/event-types", json=body, headers=viewer)).status_code == 403
    created = await api.post("/v1/event-types", json=body, headers=operator)
    assert created.status_code == 200, created.text
    bad = await api.post(
        "/v1/event-types",
        json={"name": "x.y", "schema": {"type": 3}},
        headers=operator,
    )
    assert bad.status_code == 400 and "not valid JSON Schema" in bad.json()["error"]
    patched = await api.patch(
        "/v1/event-types/order.created",
        json={"schema": {**ORDER_SCHEMA, "properties": {**ORDER_SCHEMA["properties"],
                                                         "note": {"type": "string"}}}},
        headers=operator,
    )  # fmt: skip
    assert patched.json()["version"] == 2
    shown = (await api.get("/v1/event-types/order.created", headers=viewer)).json()
    assert [v["version"] for v in shown["versions"]] == [1, 2]
    await api.post(
        "/v1/event-types",
        json={"name": "invoice.paid", "schema": {"type": "object"}},
        headers=operator,
    )
    assert (await api.post("/v1/event-types/invoice.paid/deprecate", headers=operator)).json()[
        "status"
    ] == "deprecated"
    missing = await api.get("/v1/event-types/nope", headers=viewer)
    assert missing.status_code == 404 and "no event type 'nope'" in missing.json()["error"]

    document = (await api.get("/v1/contract/openapi.json", headers=viewer)).json()
    validate(document)  # raises if it is not a valid OpenAPI 3.1 document
    hook = document["webhooks"]["order.created"]["post"]
    body_spec = hook["requestBody"]["content"]["application/json"]
    assert body_spec["schema"]["properties"]["data"]["required"] == ["id", "total"]
    assert body_spec["example"]["data"] == EXAMPLE
    assert {p["name"] for p in hook["parameters"]} == {
        "webhook-id", "webhook-timestamp", "webhook-signature"
    }  # fmt: skip
    assert document["webhooks"]["invoice.paid"]["post"]["deprecated"] is True
    # The admin API's own document lists the new routes too.
    from delivery.operator.api import openapi_document

    assert "/v1/event-types/{name}" in openapi_document()["paths"]


def test_cli_export_is_a_valid_openapi_document(cli: CliRunner, tmp_path: Path) -> None:
    add_order_type(cli, tmp_path)
    out = tmp_path / "webhooks.json"
    result = invoke(cli, "event-types", "export", "--format", "openapi", "--output", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    validate(document)
    assert document["openapi"] == "3.1.0"
    assert set(document["webhooks"]) == {"order.created", *OPERATIONAL_EVENT_TYPES}
    bare = invoke(cli, "event-types", "export", "--without-operational")
    assert list(json.loads(bare.output)["webhooks"]) == ["order.created"]
    # Broken on purpose, the validator notices (so the check above means something).
    document["webhooks"]["order.created"]["post"]["responses"] = "nope"
    with pytest.raises(Exception, match="nope"):
        validate(document)


def test_cli_publish_follows_the_setting_and_names_the_rule(
    cli: CliRunner, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_order_type(cli, tmp_path)
    broken = invoke(cli, "publish", "order.created", '{"id": "x", "total": "free"}')
    assert broken.exit_code == 1
    assert "at $.total: 'free' is not of type 'number' (rule 'type')" in broken.output
    env_file = tmp_path / "outbox.env"
    env_file.write_text("OUTBOX_EVENT_TYPES=strict\n")
    monkeypatch.setenv("OUTBOX_ENV_FILE", str(env_file))
    unknown = invoke(cli, "publish", "invoice.paid", "{}")
    assert unknown.exit_code == 1 and "not in the catalogue" in unknown.output
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 0


def test_psycopg_connections_validate_and_see_a_schema_change_made_elsewhere(
    cli: CliRunner, engine: Engine, database_url: str, tmp_path: Path
) -> None:
    """A bare psycopg connection loads the type itself (nothing cached), refuses by the
    schema, and re-reads a type changed elsewhere when its insert finds the revision stale."""
    add_order_type(cli, tmp_path)
    CACHE.clear()
    with psycopg.connect(libpq_url(database_url)) as conn:
        with pytest.raises(PublishError, match="'total' is a required property"):
            publish(conn, "order.created", {"id": "x"})
        assert publish(conn, "order.created", EXAMPLE).startswith("msg_")
    require_currency(engine)
    with psycopg.connect(libpq_url(database_url)) as conn:
        with pytest.raises(PublishError, match="'currency' is a required"):
            publish(conn, "order.created", EXAMPLE)
        conn.rollback()
        publish(conn, "order.created", {**EXAMPLE, "currency": "EUR"})
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 2


async def test_psycopg_async_connection_validates_and_sees_a_change(
    cli: CliRunner, engine: Engine, database_url: str, tmp_path: Path
) -> None:
    add_order_type(cli, tmp_path)
    CACHE.clear()
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as conn:
        with pytest.raises(PublishError, match="rule 'type'"):
            await publish_async(conn, "order.created", {"id": 5, "total": 1})
        assert (await publish_async(conn, "order.created", EXAMPLE)).startswith("msg_")
    require_currency(engine)
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as conn:
        with pytest.raises(PublishError, match="'currency' is a required"):
            await publish_async(conn, "order.created", EXAMPLE)
    assert scalar(engine, "SELECT count(*) FROM outbox_events") == 1
