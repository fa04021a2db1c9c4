"""The admin API package: its document lists exactly what each handler reads, and only
refused input is the caller's fault (400); a bug in our code is a 500 with a request id."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from delivery.operator.api import all_routes, create_app, openapi_document
from delivery.operator.api.core import Call, Dispatcher, Operation, input_names
from delivery.operator.console.sessions import WebSession
from delivery.operator.console.web import Console
from delivery.operator.context import OperatorContext
from delivery.operator.validation import StatsQuery
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.tokens import create_token


def _token(engine: Engine, role: str) -> str:
    with engine.begin() as conn:
        _, secret = create_token(conn, name=f"{role}-pkg", role=role, actor="test")
    return secret


def _schema_properties(schema: dict[str, Any], document: dict[str, Any]) -> set[str]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = document["components"]["schemas"][name]
    return set(schema.get("properties", {}))


@pytest.mark.parametrize("op", all_routes(), ids=lambda op: f"{op.method} {op.path}")
def test_every_route_documents_exactly_the_inputs_its_handler_accepts(op: Operation) -> None:
    """What the handler accepts is what its route declares (its models and path): Call
    refuses to read anything else. The document must list every one of them."""
    document = openapi_document()
    spec = document["paths"][op.path][op.method.lower()]
    documented = {(p["in"], p["name"]) for p in spec["parameters"]}
    accepted = {("path", name) for name in re.findall(r"{(\w+)}", op.path)}
    accepted |= {("query", name) for name in op.query_names()}
    assert documented == accepted
    assert {p.name for p in op.path_params} == set(re.findall(r"{(\w+)}", op.path))
    if op.body is None:
        assert "requestBody" not in spec
    else:
        schema = spec["requestBody"]["content"]["application/json"]["schema"]
        assert _schema_properties(schema, document) == input_names(op.body)


def test_the_delivery_search_documents_unreplayed() -> None:
    """The drift the generated document ended: `unreplayed` was accepted, not listed."""
    spec = openapi_document()["paths"]["/v1/deliveries"]["get"]
    names = {p["name"] for p in spec["parameters"]}
    assert {"unreplayed", "state", "before", "limit", "tenant"} <= names


def _reason_inputs() -> list[tuple[Operation, str]]:
    """Every route that takes a `reason`, and where (its body or its query string)."""
    found = []
    for op in all_routes():
        if op.body is not None and "reason" in input_names(op.body):
            found.append((op, "body"))
        elif "reason" in op.query_names():
            found.append((op, "query"))
    return found


def _documents_reason_as_required(op: Operation, where: str) -> bool:
    document = openapi_document()
    spec = document["paths"][op.path][op.method.lower()]
    if where == "query":
        return any(p["name"] == "reason" and p["required"] for p in spec["parameters"])
    schema = spec["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return "reason" in schema.get("required", ())


# What stands in for a required field that is not the reason: enough to get past the
# model to the handler, whose own checks come first on an empty database.
_FILLERS = {"array": [1], "integer": 1, "string": "x", "boolean": False}


@pytest.mark.parametrize(
    ("op", "where"), _reason_inputs(), ids=lambda v: getattr(v, "path", None) or str(v)
)
async def test_a_reason_the_handler_requires_is_required_in_the_document(
    op: Operation,
    where: str,
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
) -> None:
    """The drift the replay had: its handler refused a missing reason while the document
    said it was optional. Each route that takes a reason is called without one; when the
    answer is that the reason is missing, the document must say it is required."""
    app = create_app(async_engine, box, clock=clock)
    operator = {"authorization": f"Bearer {_token(engine, 'operator')}"}
    path = re.sub(r"{(\w+)}", lambda m: "1" if m.group(1) == "id" else "acme", op.path)
    body: dict[str, Any] | None = None
    if where == "body":
        document = openapi_document()
        schema = document["paths"][op.path][op.method.lower()]["requestBody"]["content"][
            "application/json"
        ]["schema"]
        if "$ref" in schema:
            schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        properties = schema.get("properties", {})
        body = {
            name: _FILLERS.get(properties[name].get("type", "string"), "x")
            for name in schema.get("required", ())
            if name != "reason"
        }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin", headers=operator
    ) as http:
        assert (await http.post("/v1/tenants", json={"id": "acme"})).status_code == 200
        answer = await http.request(op.method, path, json=body)
    refused_for_the_reason = answer.status_code == 400 and "reason" in answer.json()["error"]
    if refused_for_the_reason:
        assert _documents_reason_as_required(op, where), answer.json()["error"]


# -- errors -------------------------------------------------------------------------------


async def _bug(call: Call) -> Any:
    return int("not a number")  # our bug: a ValueError


async def _reads_undeclared(call: Call) -> Any:
    return {"window": call.query("windw")}  # a parameter the route does not declare


async def _stats_window(call: Call) -> Any:
    return {"window": call.query_as(StatsQuery).window}


_TEST_ROUTES = [
    Operation("GET", "/bug", None, "Raises ValueError.", _bug),
    Operation("GET", "/undeclared", None, "Reads an undeclared parameter.", _reads_undeclared),
    Operation("GET", "/window", None, "Reads its declared query.", _stats_window, query=StatsQuery),
]


@pytest.fixture
async def test_api(
    async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> AsyncIterator[httpx.AsyncClient]:
    context = OperatorContext(async_engine, box, clock=clock)
    app = Starlette(routes=Dispatcher(context).routes(_TEST_ROUTES))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        yield http


async def test_a_bug_in_a_handler_is_a_500_with_its_request_id_and_a_logged_traceback(
    test_api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="delivery.operator.api"):
        answer = await test_api.get("/bug", headers={"x-request-id": "req-bug-1"})
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "req-bug-1"
    assert answer.json()["request_id"] == "req-bug-1"
    assert "req-bug-1" in answer.json()["error"]
    assert "invalid literal" not in answer.text  # nothing of the internals
    logged = [r for r in caplog.records if "req-bug-1" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert logged[0].exc_info[0] is ValueError
    # Without a request id of its own, the caller gets a fresh one, the same in both places.
    fresh = await test_api.get("/bug")
    assert fresh.status_code == 500
    assert fresh.json()["request_id"] == fresh.headers["x-request-id"] != ""


async def test_validation_errors_stay_400_and_an_undeclared_read_is_our_bug(
    test_api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    refused = await test_api.get("/window", params={"window": "-5"})
    assert refused.status_code == 400 and refused.json()["error"].startswith("window:")
    assert (await test_api.get("/window", params={"window": "60"})).json() == {"window": 60.0}
    with caplog.at_level(logging.ERROR, logger="delivery.operator.api"):
        undeclared = await test_api.get("/undeclared", params={"windw": "60"})
    assert undeclared.status_code == 500
    assert "windw" in caplog.text and "declare it" in caplog.text


async def test_real_routes_answer_400_for_refused_input(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    app = create_app(async_engine, box, clock=clock)
    operator = {"authorization": f"Bearer {_token(engine, 'operator')}"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin", headers=operator
    ) as http:
        assert (await http.post("/v1/tenants", json={"id": "acme"})).status_code == 200
        for answer in (
            # Both were unhandled errors (a 500) before: caller input, not our bug.
            await http.post("/v1/tenants/acme/disable", json={"reason": ["why"]}),
            await http.post("/v1/tenants/acme/portal-links", json={"ttl_seconds": 10**20}),
            await http.get("/v1/deliveries", params={"limit": "0"}),
            await http.get("/v1/deliveries", params={"unreplayed": "maybe"}),
            await http.post("/v1/replays", json={"reason": "x", "ids": ["one"]}),
            await http.post("/v1/replays", content=b"{not json"),
            await http.post("/v1/tokens", json={"name": "n", "role": "viewer", "tenant": 5}),
        ):
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]


class _BrokenConsole(Console):
    async def overview(self, request: Request, session: WebSession) -> Response:
        raise TypeError("a bug in a page")


async def test_a_bug_in_a_console_page_is_a_500_with_a_request_id(
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = OperatorContext(async_engine, box, clock=clock)
    app = Starlette(routes=[*_BrokenConsole(context).routes()])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        signed_in = await http.post("/console/login", data={"token": _token(engine, "viewer")})
        assert signed_in.status_code == 303
        with caplog.at_level(logging.ERROR, logger="delivery.operator.console"):
            page = await http.get("/console/")
    assert page.status_code == 500
    request_id = page.headers["x-request-id"]
    assert request_id in page.text and "a bug in a page" not in page.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert logged[0].exc_info[0] is TypeError
