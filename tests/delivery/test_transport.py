"""Our wire behaves like httpx's own pool under `send_attempt`.

Every case runs through both transports against the real loopback receiver, so
the outcome table (deadlines, body cap, redirects, refused and dropped
connections) is proven for the production wire and httpcore's pool alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from delivery.http import (
    DEFAULT_TRANSPORT,
    AttemptResult,
    DeliveryClient,
    OutgoingRequest,
    _direct_wire,
    build_http_client,
    send_attempt,
)
from delivery.policy import Outcome
from delivery.receiver import Receiver
from delivery.ssrf import AddressPolicy
from delivery.wire import WireTransport
from outbox.clock import ManualClock
from tests.helpers import LOOPBACK, ROOT

KEY = b"k" * 32


@pytest.fixture(params=["wire", "httpx"])
async def http(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    async with build_http_client(
        max_connections=10, timeout=5, transport=request.param, allowed_networks=LOOPBACK
    ) as client:
        yield client


async def attempt(
    http: httpx.AsyncClient, url: str, *, deadline: float = 5.0, body_cap: int = 64 * 1024
) -> AttemptResult:
    request = OutgoingRequest(
        delivery_id=1, url=url, message_id="msg_1", body=b'{"a":1}', keys=[KEY], timeout=deadline
    )
    return await send_attempt(http, request, ManualClock(), body_cap=body_cap, excerpt_bytes=16)


async def test_success_sends_exactly_one_set_of_headers_and_the_body(
    http: httpx.AsyncClient, receiver: Receiver
) -> None:
    result = await attempt(http, receiver.route("/ok", status=200, body=b"thanks"))
    assert result.outcome is Outcome.SUCCEEDED
    assert result.status_code == 200
    assert result.response_excerpt == "thanks"
    [received] = receiver.received("/ok")
    assert received.method == "POST"
    assert received.body == b'{"a":1}'
    assert received.headers["webhook-id"] == "msg_1"
    assert received.headers["webhook-signature"].startswith("v1,")
    assert received.headers["user-agent"].startswith("webhook-outbox/")
    assert received.headers["content-length"] == "7"


async def test_retry_after_and_reason_phrase_come_through(
    http: httpx.AsyncClient, receiver: Receiver
) -> None:
    url = receiver.route("/busy", status=503, headers={"Retry-After": "7"})
    result = await attempt(http, url)
    assert result.outcome is Outcome.RETRYABLE
    assert result.retry_after == 7
    assert result.error == "HTTP 503 Service Unavailable"


async def test_redirect_is_not_followed(http: httpx.AsyncClient, receiver: Receiver) -> None:
    url = receiver.route("/moved", status=302, headers={"Location": receiver.url("/elsewhere")})
    result = await attempt(http, url)
    assert result.status_code == 302
    assert "redirect to" in (result.error or "")
    assert receiver.received("/elsewhere") == []


async def test_body_cap_stops_reading_and_the_client_stays_usable(
    http: httpx.AsyncClient, receiver: Receiver
) -> None:
    url = receiver.route("/huge", status=200, body=b"x" * 2_000_000)
    result = await attempt(http, url, body_cap=1024)
    assert result.outcome is Outcome.SUCCEEDED
    assert result.response_excerpt == "x" * 16
    after = await attempt(http, receiver.route("/next", status=204))
    assert after.outcome is Outcome.SUCCEEDED


async def test_one_deadline_covers_a_slow_answer(
    http: httpx.AsyncClient, receiver: Receiver
) -> None:
    began = time.perf_counter()
    result = await attempt(http, receiver.route("/slow", delay=3.0), deadline=0.3)
    assert time.perf_counter() - began < 2.0
    assert result.outcome is Outcome.AMBIGUOUS
    assert "may have arrived" in (result.error or "")


async def test_one_deadline_covers_a_trickled_body(
    http: httpx.AsyncClient, receiver: Receiver
) -> None:
    url = receiver.route("/trickle", status=200, body=b"y" * 100, trickle_interval=0.05)
    began = time.perf_counter()
    result = await attempt(http, url, deadline=0.4)
    assert time.perf_counter() - began < 2.0
    assert result.outcome is Outcome.AMBIGUOUS


async def test_refused_connection_is_retryable(http: httpx.AsyncClient) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    result = await attempt(http, f"http://127.0.0.1:{port}/gone")
    assert result.outcome is Outcome.RETRYABLE
    assert (result.error or "").startswith("connect failed")


async def test_connection_dropped_after_sending_is_ambiguous(http: httpx.AsyncClient) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await attempt(http, f"http://127.0.0.1:{port}/drop")
    finally:
        server.close()
        await server.wait_closed()
    assert result.outcome is Outcome.AMBIGUOUS
    assert "may have arrived" in (result.error or "")


async def test_transport_reconnects_after_being_closed(receiver: Receiver) -> None:
    transport = WireTransport(policy=AddressPolicy(LOOPBACK), max_connections=2)
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.post(receiver.route("/a"), content=b"1")).status_code == 200
        await transport.aclose()
        assert (await client.post(receiver.route("/a"), content=b"2")).status_code == 200
    assert [r.body for r in receiver.received("/a")] == [b"1", b"2"]


def test_unknown_transport_name_is_refused() -> None:
    with pytest.raises(ValueError, match="wire, httpx"):
        build_http_client(max_connections=1, timeout=1, transport="curl")
    with pytest.raises(ValueError, match="wire, httpx"):
        build_http_client(max_connections=1, timeout=1, transport="aiohttp")


def test_the_removed_aiohttp_setting_is_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbox.errors import ConfigurationError
    from outbox.settings import load_settings

    monkeypatch.setenv("OUTBOX_HTTP_TRANSPORT", "aiohttp")
    with pytest.raises(ConfigurationError, match=r"OUTBOX_HTTP_TRANSPORT: .*'wire' or 'httpx'"):
        load_settings()


@pytest.mark.parametrize("transport", ["wire", "httpx"])
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_both_transports_carry_the_ssrf_guard(
    receiver: Receiver, transport: str, host: str
) -> None:
    url = receiver.route("/internal").replace("127.0.0.1", host)
    async with build_http_client(max_connections=2, timeout=5, transport=transport) as guarded:
        result = await attempt(guarded, url)
    assert result.outcome is Outcome.PERMANENT
    assert "refused to connect" in (result.error or "")
    assert receiver.requests == []


@pytest.mark.parametrize("transport", ["wire", "httpx"])
async def test_both_transports_honour_https_only(receiver: Receiver, transport: str) -> None:
    async with build_http_client(
        max_connections=2,
        timeout=5,
        transport=transport,
        allowed_networks=LOOPBACK,
        https_only=True,
    ) as strict:
        result = await attempt(strict, receiver.route("/plain"))
    assert result.outcome is Outcome.PERMANENT
    assert "only https" in (result.error or "")
    assert receiver.requests == []


@pytest.mark.parametrize("transport", ["wire", "httpx"])
async def test_direct_path_sends_what_the_httpx_path_sends(
    receiver: Receiver, transport: str
) -> None:
    """The attempt skips httpx's client layers (and, on the wire, its request/response
    models) unless the client has something of its own (here an event hook); the
    receiver sees the same request."""
    hooked: list[str] = []

    async def hook(request: httpx.Request) -> None:
        hooked.append(str(request.url))

    url = receiver.route("/same", status=503, headers={"retry-after": "7"})
    async with build_http_client(
        max_connections=2, timeout=5, transport=transport, allowed_networks=LOOPBACK
    ) as direct:
        assert (_direct_wire(direct) is not None) == (transport == "wire")
        first = await attempt(direct, url)
    async with build_http_client(
        max_connections=2, timeout=5, transport=transport, allowed_networks=LOOPBACK
    ) as full:
        full.event_hooks["request"] = [hook]
        assert _direct_wire(full) is None
        second = await attempt(full, url)
    assert hooked == [url]
    one, two = receiver.received("/same")
    assert one.headers == two.headers  # same names, values and order (timestamps equal too)
    assert one.body == two.body
    for result in (first, second):
        assert (result.outcome, result.status_code, result.retry_after) == (
            Outcome.RETRYABLE,
            503,
            7.0,
        )
        assert result.error == "HTTP 503 Service Unavailable"


async def test_one_default_everywhere() -> None:
    """The wire is the default of the client builder, the service and the setting."""
    import inspect

    from delivery.operator.app import Service
    from outbox.settings import Settings

    assert DEFAULT_TRANSPORT == "wire"
    assert Settings.model_fields["http_transport"].default == "wire"
    assert inspect.signature(Service).parameters["http_transport"].default == "wire"
    async with build_http_client(max_connections=1, timeout=1) as client:
        assert isinstance(client, DeliveryClient)
        assert isinstance(client.delivery_transport, WireTransport)


def test_nothing_on_the_send_path_imports_aiohttp() -> None:
    """aiohttp is only the bench's raw ceiling (the bench extra), not a dependency."""
    import subprocess
    import sys

    probe = (
        "import sys, delivery.http, delivery.wire, delivery.worker, delivery.operator.app, "
        "delivery.operator.cli; print('aiohttp' in sys.modules)"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert found.strip() == "False"


HTTP_LIBRARIES = ("httpx", "httpcore")
SCANNED_PACKAGES = ("delivery", "outbox", "bench", "tools")


def _scanned_files() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), path.read_text())
        for package in SCANNED_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    ]


def _library_private_names(base: type) -> set[str]:
    """Every private name that httpx's or httpcore's classes in `base`'s MRO define or
    use as `self._name` (read from their methods: httpx re-labels its public classes'
    `__module__`, so `inspect.getsource` cannot find the classes themselves)."""
    import ast
    import inspect
    import textwrap

    names: set[str] = set()
    for cls in base.__mro__:
        if cls.__module__.split(".")[0] not in HTTP_LIBRARIES:
            continue
        names.update(name for name in vars(cls) if name.startswith("_") and not _dunder(name))
        for member in vars(cls).values():
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            functions = (
                [member.fget, member.fset, member.fdel]
                if isinstance(member, property)
                else [member]
            )
            for function in functions:
                if not inspect.isfunction(function):
                    continue
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
                names.update(
                    node.attr
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and node.attr.startswith("_")
                    and not _dunder(node.attr)
                )
    return names


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def private_http_library_access(source: str) -> list[tuple[int, str]]:
    """Where `source` reaches into httpx's or httpcore's private parts: imports from their
    private modules or names, `httpx._x` attributes, and subclasses of their classes
    that touch a private attribute the library's class uses (`self._pool = ...` on an
    `httpx.AsyncHTTPTransport` subclass)."""
    import ast
    import importlib

    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> httpx or httpcore
    imported: dict[str, object] = {}  # local name -> an object imported from them
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top in HTTP_LIBRARIES:
                    modules[alias.asname or top] = top
                    if rest.startswith("_") or "._" in rest:
                        found.append((node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            top, _, rest = node.module.partition(".")
            if top not in HTTP_LIBRARIES:
                continue
            if rest.startswith("_") or "._" in rest:
                found.append((node.lineno, f"imports from {node.module}"))
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append((node.lineno, f"imports {node.module}.{alias.name}"))
                else:
                    module = importlib.import_module(node.module)
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not _dunder(node.attr)
        ):
            found.append((node.lineno, f"reads {node.value.id}.{node.attr}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        private: set[str] = set()
        for base in node.bases:
            library_class: object = None
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                if base.value.id in modules:
                    module = importlib.import_module(modules[base.value.id])
                    library_class = getattr(module, base.attr)
            elif isinstance(base, ast.Name):
                library_class = imported.get(base.id)
            if isinstance(library_class, type):
                private |= _library_private_names(library_class)
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
                and inner.attr in private
            ):
                found.append(
                    (
                        inner.lineno,
                        f"{node.name} touches self.{inner.attr} of its httpx/httpcore base",
                    )
                )
    return sorted(set(found))


def test_no_private_httpx_attributes_are_read() -> None:
    """httpx has no public accessor for a client's transport nor a public way to give
    its transport a network backend; reading or replacing its private attributes
    (`_transport`, `_transport_for_url`, `_mounts`, a transport's `_pool`) or importing
    its private modules breaks on any httpx release. The same holds for httpcore."""
    import re

    offending = [
        f"{name}:{number}"
        for name, text in _scanned_files()
        for number, line in enumerate(text.splitlines(), 1)
        if re.search(r"client\._|_transport_for_url|\._mounts\b", line)
    ]
    offending += [
        f"{name}:{number}: {what}"
        for name, text in _scanned_files()
        for number, what in private_http_library_access(text)
    ]
    assert offending == []


def test_the_private_access_check_sees_each_way_in() -> None:
    """The check above is only as good as what it recognises: each form is caught, and
    our own private attributes on subclasses of httpx's abstract classes are not."""
    caught = """
import httpx
import httpcore as core
import httpx._transports.default
from httpx._config import DEFAULT_LIMITS
from httpx import _utils
from httpx import AsyncHTTPTransport as Base

limits = httpx._config.DEFAULT_LIMITS

class Swapped(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self._pool = core.AsyncConnectionPool()

class Aliased(Base):
    async def aclose(self) -> None:
        await self._pool.aclose()

class Peeking(httpx.AsyncClient):
    def transport(self) -> object:
        return self._transport
"""
    assert [what for _, what in private_http_library_access(caught)] == [
        "imports httpx._transports.default",
        "imports from httpx._config",
        "imports httpx._utils",
        "reads httpx._config",
        "Swapped touches self._pool of its httpx/httpcore base",
        "Aliased touches self._pool of its httpx/httpcore base",
        "Peeking touches self._transport of its httpx/httpcore base",
    ]
    clean = """
import httpcore
import httpx

class Owned(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self._pool = httpcore.AsyncConnectionPool()

class Stream(httpx.AsyncByteStream):
    def __init__(self) -> None:
        self._stream = b""
"""
    assert private_http_library_access(clean) == []
