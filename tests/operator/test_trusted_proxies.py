"""Who the client is, for every peer and X-Forwarded-For, checked against a reference.

The admin server hands OUTBOX_TRUSTED_PROXIES to uvicorn (delivery.operator.api.
forwarded_options), whose proxy middleware then decides the client address that rate
limits and the audit log use. This pins that decision, with uvicorn as installed, to
the rule docs/security.md states: a peer that is not a trusted proxy is the client, whatever
it sends; behind a trusted proxy the client is the rightmost forwarded address that is
not itself a trusted proxy (the leftmost when all are), and only then does
X-Forwarded-Proto count.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from delivery.operator.api import forwarded_options
from outbox.settings import Settings

POOL = [
    "10.0.0.1",
    "10.0.0.2",
    "10.0.1.7",
    "127.0.0.1",
    "192.0.2.1",
    "198.51.100.9",
    "::1",
    "2001:db8::1",
    "2001:db8:1::5",
]
NETWORKS = [
    "10.0.0.0/24",
    "10.0.0.1",
    "127.0.0.1",
    "192.0.2.0/24",
    "::1",
    "2001:db8::/64",
    "0.0.0.0/0",
]
addresses = st.one_of(st.sampled_from(POOL), st.ip_addresses().map(str))
hops = st.one_of(addresses, st.sampled_from(["unknown", "_hidden"]))


def reference(
    trusted: list[str], peer: str, forwarded: list[str] | None, proto: str | None
) -> tuple[str, str]:
    """(client, scheme) by the documented rule, from scratch."""
    networks = [ipaddress.ip_network(n) for n in trusted]

    def is_proxy(host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in networks)

    if not is_proxy(peer):
        return peer, "http"
    scheme = proto if proto in ("http", "https") else "http"
    if not forwarded:
        return peer, scheme
    for hop in reversed(forwarded):
        if not is_proxy(hop):
            return hop, scheme
    return forwarded[0], scheme


def served(
    trusted: list[str], peer: str, forwarded: list[str] | None, proto: str | None
) -> tuple[str, str]:
    """(client, scheme) as the app sees them behind uvicorn configured like serve() does."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["client"], seen["scheme"] = scope["client"][0], scope["scheme"]

    config = uvicorn.Config(app, log_config=None, **forwarded_options(trusted))
    config.load()
    headers = []
    if forwarded is not None:
        headers.append((b"x-forwarded-for", ", ".join(forwarded).encode()))
    if proto is not None:
        headers.append((b"x-forwarded-proto", proto.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": (peer, 40000),
        "server": ("127.0.0.1", 8181),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    asyncio.run(config.loaded_app(scope, receive, send))
    return seen["client"], seen["scheme"]


class _GivenSettings(Settings):
    """The settings from the values given only: the same fields and validators, without
    reading every OUTBOX_* variable and the .env file (most of an example's time)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


@settings(max_examples=300, deadline=None)
@given(
    trusted=st.lists(st.sampled_from(NETWORKS), max_size=4),
    peer=addresses,
    forwarded=st.none() | st.lists(hops, min_size=1, max_size=5),
    proto=st.sampled_from([None, "https", "http", "gopher"]),
)
def test_the_client_is_who_the_rule_says(
    trusted: list[str], peer: str, forwarded: list[str] | None, proto: str | None
) -> None:
    # Through the settings, as an operator writes them (normalised to networks).
    networks = _GivenSettings(trusted_proxies=",".join(trusted)).trusted_proxies
    assert served(networks, peer, forwarded, proto) == reference(networks, peer, forwarded, proto)


def test_by_default_no_peer_is_a_proxy_loopback_included() -> None:
    assert forwarded_options(()) == {"proxy_headers": False, "forwarded_allow_ips": []}
    assert served([], "127.0.0.1", ["192.0.2.7"], "https") == ("127.0.0.1", "http")
    assert served([], "::1", ["192.0.2.7"], None) == ("::1", "http")
