"""The SSRF guard, against real sockets on loopback only.

Safety: every transport in these tests dials through `LoopbackOnlyBackend`, which
fails the test instead of connecting anywhere outside 127.0.0.0/8, so even a broken
guard cannot send traffic off this machine. Names such as `hook.test` are answered
by injected resolvers; the system resolver only ever sees numeric hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from delivery.errors import (
    AddressRefusedError,
    DeliveryConfigurationError,
    DeliveryError,
    InvalidEndpointURLError,
)
from delivery.ssrf import (
    AddressPolicy,
    GuardedNetworkBackend,
    build_guarded_transport,
    normalise_address,
    system_resolver,
    validate_endpoint_url,
)
from outbox.errors import ConfigurationError, EndpointError
from tests.delivery.loopback import (
    StartReceiver,
    answers,
    tls_contexts,
    tls_receiver_recording_sni,
)


class LoopbackOnlyBackend(httpcore.AsyncNetworkBackend):
    """Records what the guard dials; refuses (fails the test) to dial off loopback."""

    def __init__(self) -> None:
        self.inner = httpcore.AnyIOBackend()
        self.dialled: list[str] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.dialled.append(host)
        if not ipaddress.ip_address(host).is_loopback:
            pytest.fail(f"test safety: the guard tried to dial {host}, off loopback")
        return await self.inner.connect_tcp(host, port, timeout, local_address, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def client(
    allowed: Sequence[str] = (),
    resolver: Callable[[str, int], Awaitable[Sequence[str]]] | None = None,
    **kw: object,
) -> tuple[httpx.AsyncClient, LoopbackOnlyBackend]:
    backend = LoopbackOnlyBackend()
    verify = kw.pop("verify", True)
    https_only = bool(kw.pop("https_only", False))
    transport = build_guarded_transport(
        AddressPolicy(allowed),
        resolver=resolver,
        backend=backend,
        verify=verify,  # type: ignore[arg-type]
        https_only=https_only,
    )
    return httpx.AsyncClient(transport=transport, timeout=5.0, **kw), backend  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the policy

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "metadata"),
    ("169.254.1.1", "link-local"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.255", "carrier-grade NAT"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "broadcast"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "this network"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.255", "benchmarking"),
    ("192.0.0.170", "IETF protocol"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fc00::1", "unique local"),
    ("fd12:3456::1", "unique local"),
    ("fe80::1", "link-local"),
    ("fe80::1%eth0", "link-local"),
    ("fd00:ec2::254", "AWS instance metadata"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("100::1", "discard"),
    ("64:ff9b:1::1", "local-use NAT64"),
    ("4000::1", "reserved IPv6"),
    ("::127.0.0.1", "reserved IPv6"),  # deprecated IPv4-compatible form
    # IPv4-mapped IPv6 is judged as the IPv4 address it reaches
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "metadata"),
    # transition mechanisms that embed a refused IPv4 address
    ("2002:7f00:1::1", "6to4 address that embeds 127.0.0.1"),
    ("2002:a9fe:a9fe::1", "6to4 address that embeds 169.254.169.254"),
    ("64:ff9b::a9fe:a9fe", "NAT64 address that embeds 169.254.169.254"),
    ("64:ff9b::10.0.0.1", "NAT64 address that embeds 10.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "Teredo address that embeds 127.0.0.1"),
]


@pytest.mark.parametrize(("ip", "reason"), REFUSED)
def test_special_purpose_addresses_are_refused(ip: str, reason: str) -> None:
    with pytest.raises(AddressRefusedError) as caught:
        AddressPolicy([]).check(ip)
    assert reason in caught.value.reason
    assert isinstance(caught.value, DeliveryError)
    assert not isinstance(caught.value, httpx.HTTPError)


@pytest.mark.parametrize(
    "ip",
    [
        "93.184.216.34",
        "8.8.8.8",
        "100.63.255.255",  # just below CGNAT
        "100.128.0.0",  # just above CGNAT
        "172.15.255.255",
        "172.32.0.0",
        "198.17.255.255",
        "198.20.0.0",
        "2606:4700:4700::1111",
        "2002:808:808::1",  # 6to4 of a public address
        "64:ff9b::8.8.8.8",  # NAT64 of a public address
        "::ffff:8.8.8.8",
    ],
)
def test_public_addresses_pass(ip: str) -> None:
    AddressPolicy([]).check(ip)  # pure check: nothing is dialled


def test_refusal_names_the_address_and_what_to_do() -> None:
    with pytest.raises(AddressRefusedError) as caught:
        AddressPolicy([]).check("::ffff:169.254.169.254")
    assert caught.value.address == "169.254.169.254"
    message = str(caught.value)
    assert "169.254.169.254" in message
    assert "OUTBOX_ALLOWED_NETWORKS" in message


def test_allowed_networks_open_only_their_range() -> None:
    policy = AddressPolicy(["127.0.0.0/8", " 10.20.0.0/16 ", "fd12::/16", "127.0.0.2"])
    for ip in ["127.0.0.1", "::ffff:127.0.0.1", "10.20.3.4", "fd12::1", "127.0.0.2"]:
        policy.check(ip)
    for ip in ["::1", "10.21.0.1", "fd13::1", "169.254.169.254"]:
        with pytest.raises(AddressRefusedError):
            policy.check(ip)


def test_allowed_network_also_covers_addresses_that_embed_it() -> None:
    AddressPolicy(["10.0.0.0/8"]).check("2002:a00:1::1")  # 6to4 of 10.0.0.1


def test_policy_takes_address_objects_and_refuses_names() -> None:
    AddressPolicy([]).check(ipaddress.ip_address("8.8.8.8"))
    with pytest.raises(AddressRefusedError, match="not an IP address"):
        AddressPolicy([]).check("localhost")


@pytest.mark.parametrize(
    ("entry", "hint"),
    [
        ("10.0.0.1/8", "did you mean 10.0.0.0/8"),
        ("not-a-network", "CIDR form"),
        ("10.0.0.0/33", "CIDR form"),
        ("", "CIDR form"),
        ("::ffff:127.0.0.0/104", "write the IPv4 network"),
    ],
)
def test_bad_allowed_networks_fail_at_start_up(entry: str, hint: str) -> None:
    with pytest.raises(DeliveryConfigurationError, match=hint) as caught:
        AddressPolicy(["127.0.0.0/8", entry])
    assert "OUTBOX_ALLOWED_NETWORKS" in str(caught.value)
    assert isinstance(caught.value, ConfigurationError)  # the CLI's existing handler


def test_mapped_addresses_normalise_to_ipv4() -> None:
    assert normalise_address("::ffff:127.0.0.1") == ipaddress.IPv4Address("127.0.0.1")
    assert normalise_address("::1") == ipaddress.IPv6Address("::1")


# ----------------------------------------------------------- numeric spellings of hosts


@pytest.mark.parametrize(
    "host",
    ["2130706433", "0x7f000001", "127.1", "017700000001", "0177.0.0.1", "::ffff:127.0.0.1"],
)
async def test_system_resolver_normalises_numeric_hosts(host: str) -> None:
    # getaddrinfo parses these itself (inet_aton rules); no DNS query is made.
    resolved = await system_resolver(host, 80)
    assert [normalise_address(a) for a in resolved] == [ipaddress.IPv4Address("127.0.0.1")]


@pytest.mark.parametrize("host", ["2130706433", "0x7f000001", "127.1", "017700000001"])
async def test_numeric_hosts_are_refused_at_connect(
    host: str, start_receiver: StartReceiver
) -> None:
    receiver = await start_receiver("127.0.0.1")
    http, backend = client(allowed=[])  # the real system resolver
    async with http:
        with pytest.raises(AddressRefusedError) as caught:
            await http.post(f"http://{host}:{receiver.port}/hook", content=b"{}")
    assert caught.value.address == "127.0.0.1"
    assert caught.value.host == host
    assert backend.dialled == []
    assert receiver.requests == []


# ------------------------------------------------------------ connecting through httpx


async def test_allowed_loopback_receiver_is_reachable(start_receiver: StartReceiver) -> None:
    receiver = await start_receiver("127.0.0.1")
    http, backend = client(allowed=["127.0.0.0/8"])
    async with http:
        response = await http.post(receiver.url, content=b'{"a":1}')
        numeric = await http.post(f"http://2130706433:{receiver.port}/n", content=b"x")
    assert response.status_code == 200
    assert numeric.status_code == 200
    assert [r.body for r in receiver.requests] == [b'{"a":1}', b"x"]
    assert receiver.requests[1].headers["host"] == f"2130706433:{receiver.port}"
    assert backend.dialled == ["127.0.0.1", "127.0.0.1"]


async def test_refusal_reaches_the_caller_as_address_refused_error(
    start_receiver: StartReceiver,
) -> None:
    """httpx only maps httpcore's exceptions, so ours passes through unchanged."""
    receiver = await start_receiver("127.0.0.1")
    http, backend = client(allowed=[])
    async with http:
        with pytest.raises(AddressRefusedError) as caught:
            await http.post(receiver.url, content=b"{}")
    assert type(caught.value) is AddressRefusedError
    assert caught.value.reason == "a loopback address"
    assert backend.dialled == []
    assert receiver.requests == []


async def test_hostname_resolving_to_a_private_address_is_refused() -> None:
    resolve, asked = answers(["10.0.0.5"])
    http, backend = client(allowed=[], resolver=resolve)
    async with http:
        with pytest.raises(AddressRefusedError) as caught:
            await http.get("http://hook.test/")
    assert asked == ["hook.test"]
    assert "'hook.test' (10.0.0.5)" in str(caught.value)
    assert backend.dialled == []


async def test_one_refused_answer_refuses_the_connection(start_receiver: StartReceiver) -> None:
    receiver = await start_receiver("127.0.0.2")
    resolve, _ = answers(["127.0.0.2", "127.0.0.1"])
    http, backend = client(allowed=["127.0.0.2/32"], resolver=resolve)
    async with http:
        with pytest.raises(AddressRefusedError) as caught:
            await http.get(f"http://hook.test:{receiver.port}/")
    assert caught.value.address == "127.0.0.1"
    assert backend.dialled == []
    assert receiver.requests == []


async def test_rebinding_answer_is_refused_and_only_checked_literals_are_dialled(
    start_receiver: StartReceiver,
) -> None:
    """First answer allowed, second (rebound) answer refused; the name is never re-resolved."""
    allowed = await start_receiver("127.0.0.2")
    try:
        rebound_target = await start_receiver("127.0.0.1", port=allowed.port)
    except OSError:  # pragma: no cover - the port is taken on 127.0.0.1 by chance
        rebound_target = None
    resolve, asked = answers(["127.0.0.2"], ["127.0.0.1"])
    http, backend = client(allowed=["127.0.0.2/32"], resolver=resolve)
    url = f"http://hook.test:{allowed.port}/hook"
    async with http:
        first = await http.post(url, content=b"1")
        with pytest.raises(AddressRefusedError) as caught:
            await http.post(url, content=b"2")
    assert first.status_code == 200
    assert caught.value.address == "127.0.0.1"
    assert caught.value.host == "hook.test"
    assert asked == ["hook.test", "hook.test"]  # one resolution per connection
    assert backend.dialled == ["127.0.0.2"]  # the checked literal, never the name
    assert [r.body for r in allowed.requests] == [b"1"]
    assert allowed.requests[0].headers["host"] == f"hook.test:{allowed.port}"
    if rebound_target is not None:
        assert rebound_target.requests == []


async def test_mapped_answer_is_dialled_as_ipv4(start_receiver: StartReceiver) -> None:
    receiver = await start_receiver("127.0.0.2")
    resolve, _ = answers(["::ffff:127.0.0.2"])
    http, backend = client(allowed=["127.0.0.2/32"], resolver=resolve)
    async with http:
        response = await http.get(f"http://hook.test:{receiver.port}/")
    assert response.status_code == 200
    assert backend.dialled == ["127.0.0.2"]


async def test_next_checked_address_is_tried_when_one_does_not_answer(
    start_receiver: StartReceiver,
) -> None:
    receiver = await start_receiver("127.0.0.2")
    with socket.socket() as probe:  # make sure nothing listens on 127.0.0.3:<port>
        if probe.connect_ex(("127.0.0.3", receiver.port)) == 0:  # pragma: no cover
            pytest.skip("something listens on 127.0.0.3 at this port")
    resolve, _ = answers(["127.0.0.3", "127.0.0.2"])
    http, backend = client(allowed=["127.0.0.2/32", "127.0.0.3/32"], resolver=resolve)
    async with http:
        response = await http.get(f"http://hook.test:{receiver.port}/")
    assert response.status_code == 200
    assert backend.dialled == ["127.0.0.3", "127.0.0.2"]


async def test_dns_failure_is_a_retryable_connect_error() -> None:
    async def fail(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    http, _ = client(resolver=fail)
    async with http:
        with pytest.raises(httpx.ConnectError, match=r"could not resolve 'hook\.test'"):
            await http.get("http://hook.test/")

    empty, _ = answers([])
    http, _ = client(resolver=empty)
    async with http:
        with pytest.raises(httpx.ConnectError, match="no addresses"):
            await http.get("http://hook.test/")


async def test_resolution_counts_against_the_connect_timeout() -> None:
    never = asyncio.Event()

    async def hang(host: str, port: int) -> list[str]:
        await never.wait()
        raise AssertionError("unreachable")

    http, backend = client(resolver=hang)
    async with http:
        with pytest.raises(httpx.ConnectTimeout, match=r"resolving 'hook\.test'"):
            # bounded here too, so a guard that stopped timing resolution fails, not hangs
            get = http.get("http://hook.test/", timeout=httpx.Timeout(5.0, connect=0.01))
            await asyncio.wait_for(get, 5)
    assert backend.dialled == []


async def test_unix_sockets_are_refused() -> None:
    backend = GuardedNetworkBackend(AddressPolicy(["0.0.0.0/0"]))
    with pytest.raises(AddressRefusedError, match="Unix socket"):
        await backend.connect_unix_socket("/run/docker.sock")


async def test_https_only_transport_refuses_plain_http(start_receiver: StartReceiver) -> None:
    receiver = await start_receiver("127.0.0.1")
    http, backend = client(allowed=["127.0.0.0/8"], https_only=True)
    async with http:
        with pytest.raises(InvalidEndpointURLError, match="only https"):
            await http.get(receiver.url)
    assert backend.dialled == []
    assert receiver.requests == []


# ------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("location", ["http://169.254.169.254/latest/meta-data/", "second"])
async def test_redirect_is_returned_not_followed(
    location: str, start_receiver: StartReceiver
) -> None:
    second = await start_receiver("127.0.0.3")
    target = second.url if location == "second" else location
    first = await start_receiver("127.0.0.1", status=302, response_headers={"location": target})
    http, backend = client(allowed=["127.0.0.0/8"])
    async with http:
        response = await http.post(first.url, content=b"{}")
    assert response.status_code == 302
    assert response.headers["location"] == target
    assert backend.dialled == ["127.0.0.1"]
    assert len(first.requests) == 1
    assert second.requests == []


async def test_followed_redirect_would_still_be_guarded(start_receiver: StartReceiver) -> None:
    """Defence in depth: even a client that follows redirects cannot reach a refused hop."""
    second = await start_receiver("127.0.0.3")
    first = await start_receiver("127.0.0.1", status=302, response_headers={"location": second.url})
    http, backend = client(allowed=["127.0.0.1/32"], follow_redirects=True)
    async with http:
        with pytest.raises(AddressRefusedError) as caught:
            await http.get(first.url)
    assert caught.value.address == "127.0.0.3"
    assert backend.dialled == ["127.0.0.1"]
    assert second.requests == []


# ----------------------------------------------------------------------------- TLS


async def test_tls_verifies_and_sends_sni_for_the_hostname_not_the_dialled_ip(
    start_receiver: StartReceiver, tmp_path: Path
) -> None:
    receiver, client_ctx, sni = await tls_receiver_recording_sni(start_receiver, tmp_path)
    resolve, _ = answers(["127.0.0.2"])
    http, backend = client(allowed=["127.0.0.2/32"], resolver=resolve, verify=client_ctx)
    async with http:
        response = await http.post(f"https://hook.test:{receiver.port}/hook", content=b"{}")
    assert response.status_code == 200
    assert sni == ["hook.test"]
    assert backend.dialled == ["127.0.0.2"]
    assert receiver.requests[0].headers["host"] == f"hook.test:{receiver.port}"


# ------------------------------------------------------------------ URL validation


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("https://example.com/hook", "https://example.com/hook"),
        ("HTTPS://Example.COM:443/a?b=1", "https://example.com/a?b=1"),
        ("http://example.com", "http://example.com/"),
        ("http://example.com:8080/x?u=a@b", "http://example.com:8080/x?u=a@b"),
        ("http://例え.jp/p", "http://xn--r8jz45g.jp/p"),
        ("http://[2001:DB8:0::1]:81/", "http://[2001:db8::1]:81/"),
        ("http://2130706433:8080/x", "http://127.0.0.1:8080/x"),
        ("http://0x7f000001/", "http://127.0.0.1/"),
        ("http://127.1/", "http://127.0.0.1/"),
        ("http://017700000001/", "http://127.0.0.1/"),
        ("http://[::ffff:169.254.169.254]/", "http://169.254.169.254/"),
        ("https://my_host.internal./", "https://my_host.internal./"),
    ],
)
def test_valid_urls_are_normalised(url: str, normalised: str) -> None:
    assert validate_endpoint_url(url) == normalised


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "empty"),
        ("ftp://example.com/", "must start with http:// or https://"),
        ("javascript:alert(1)", "must start with http"),
        ("example.com/hook", "must start with http"),
        ("http:///hook", "no host"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://@example.com/", "credentials"),
        ("http://example.com/#frag", "fragment"),
        ("http://example.com/#", "fragment"),
        ("http://example.com:0/", "port 0 is out of range"),
        ("http://example.com:65536/", "port 65536 is out of range"),
        ("http://example.com:abc/", "not a valid URL"),
        ("http://exa mple.com/", "whitespace or a control character"),
        (" http://example.com/", "whitespace"),
        ("http://example.com/\r\nX-Injected: 1", "control character"),
        ("http://example.com/\x00", "control character"),
        ("http://example.com/\u2028", "control character"),
        ("http://exa%41mple.com/", "'%'"),
        ("http://[fe80::1%25eth0]/", "zone ids"),
        ("http://1.2.3.4.5/", "looks like an IPv4 address"),
        ("http://999.1.1.1/", "IPv4 address"),
        ("http://foo.0x1ff/", "looks like an IPv4 address"),
        ("http://a..b/", "not a valid host name"),
        ("http://-a.example/", "not a valid host name"),
        ("http://" + "a" * 64 + ".example/", "not a valid host name"),
        ("https://example.com/" + "a" * 2048, "the limit is 2048"),
    ],
)
def test_invalid_urls_are_refused_with_a_reason(url: str, message: str) -> None:
    with pytest.raises(InvalidEndpointURLError, match=message) as caught:
        validate_endpoint_url(url)
    assert isinstance(caught.value, EndpointError)


def test_https_only_refuses_http() -> None:
    assert validate_endpoint_url("https://example.com/", https_only=True) == "https://example.com/"
    with pytest.raises(InvalidEndpointURLError, match="only sends over https"):
        validate_endpoint_url("http://example.com/", https_only=True)


def test_length_cap_is_inclusive() -> None:
    base = "https://example.com/"
    url = base + "a" * (2048 - len(base))
    assert validate_endpoint_url(url) == url


# -- the same guard for the wire -----------------------------------------------------------


async def test_guarded_resolver_checks_every_answer_and_returns_literals() -> None:
    from delivery.ssrf import GuardedResolver

    answers = {
        "mixed.test": ["127.0.0.2", "10.0.0.1"],
        "ok.test": ["127.0.0.2", "::ffff:127.0.0.2"],
    }

    async def fake(host: str, port: int) -> list[str]:
        return answers[host]

    resolver = GuardedResolver(AddressPolicy(["127.0.0.2/32"]), resolver=fake)
    assert await resolver.resolve("ok.test", 443) == ["127.0.0.2", "127.0.0.2"]
    with pytest.raises(AddressRefusedError) as refused:
        await resolver.resolve("mixed.test", 443)
    assert refused.value.address == "10.0.0.1"
    assert refused.value.host == "mixed.test"


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "::ffff:127.0.0.1", "169.254.169.254"])
def test_literal_hosts_are_checked_without_a_resolver(host: str) -> None:
    from delivery.ssrf import check_literal_host

    with pytest.raises(AddressRefusedError):
        check_literal_host(AddressPolicy(), host)
    check_literal_host(AddressPolicy(), "example.com")  # names are the resolver's job


# -- what the guard says and passes on (mutation testing: docs/mutation.md) ---------------


def test_a_name_is_refused_as_itself_with_the_reason_users_see() -> None:
    with pytest.raises(AddressRefusedError) as caught:
        AddressPolicy([]).check("localhost")
    assert caught.value.address == "localhost"
    assert caught.value.reason == "not an IP address (the guard only dials resolved literals)"


def test_policy_repr_lists_its_allowed_networks() -> None:
    assert repr(AddressPolicy(["10.20.0.0/16", "fd12::/16"])) == (
        "AddressPolicy(['10.20.0.0/16', 'fd12::/16'])"
    )


@pytest.mark.parametrize(
    ("ip", "reason"),
    [
        ("4000::1", "reserved IPv6 space (outside global unicast 2000::/3)"),
        # Teredo: the server (10.0.0.1) is refused even though the client (8.8.8.8) is public
        (
            "2001:0:a00:1::f7f7:f7f7",
            "a Teredo address that embeds 10.0.0.1, which is a private address (RFC 1918)",
        ),
        (
            "2002:7f00:1::1",
            "a 6to4 address that embeds 127.0.0.1, which is a loopback address",
        ),
    ],
)
def test_refusal_reasons_are_exact(ip: str, reason: str) -> None:
    with pytest.raises(AddressRefusedError) as caught:
        AddressPolicy([]).check(ip)
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        (
            "not-a-network",
            r"OUTBOX_ALLOWED_NETWORKS entry 'not-a-network' is not a network in CIDR form "
            r"such as 10\.20\.0\.0/16 or fd12:3456::/48 \('not-a-network' does not appear "
            r"to be an IPv4 or IPv6 network\)",
        ),
        (
            " 10.0.0.1/8",
            r"OUTBOX_ALLOWED_NETWORKS entry ' 10\.0\.0\.1/8' is not a network in CIDR form "
            r"such as 10\.20\.0\.0/16 or fd12:3456::/48 \(10\.0\.0\.1/8 has host bits set\); "
            r"did you mean 10\.0\.0\.0/8\?",
        ),
        (
            "::ffff:127.0.0.0/104",
            r"OUTBOX_ALLOWED_NETWORKS entry '::ffff:127\.0\.0\.0/104' is IPv4-mapped IPv6; "
            r"addresses are checked as plain IPv4, so write the IPv4 network instead",
        ),
    ],
)
def test_bad_allowed_network_messages_are_exact(entry: str, pattern: str) -> None:
    with pytest.raises(DeliveryConfigurationError) as caught:
        AddressPolicy([entry])
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)


@dataclass
class Dial:
    host: str
    port: int
    timeout: float | None
    local_address: str | None
    socket_options: list[httpcore.SOCKET_OPTION] | None


class RecordingBackend(LoopbackOnlyBackend):
    """Records every argument the guard dials with (still loopback only)."""

    def __init__(self) -> None:
        super().__init__()
        self.dials: list[Dial] = []
        self.slept: list[float] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        options = None if socket_options is None else list(socket_options)
        self.dials.append(Dial(host, port, timeout, local_address, options))
        return await super().connect_tcp(host, port, timeout, local_address, options)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await super().sleep(seconds)


@contextlib.contextmanager
def refusing_port(host: str) -> Iterator[int]:
    """A port on `host` that refuses connections at once (bound, never listening)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


async def test_one_deadline_covers_every_address_and_dial_arguments_pass_through(
    start_receiver: StartReceiver,
) -> None:
    receiver = await start_receiver("127.0.0.2")
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return ["127.0.0.3", "127.0.0.2"]

    with socket.socket() as probe:  # make sure nothing listens on 127.0.0.3:<port>
        if probe.connect_ex(("127.0.0.3", receiver.port)) == 0:  # pragma: no cover
            pytest.skip("something listens on 127.0.0.3 at this port")
    backend = RecordingBackend()
    guard = GuardedNetworkBackend(AddressPolicy(["127.0.0.0/8"]), resolver=resolve, backend=backend)
    options: list[httpcore.SOCKET_OPTION] = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    stream = await guard.connect_tcp(
        "hook.test",
        receiver.port,
        timeout=0.5,
        local_address="127.0.0.1",
        socket_options=iter(options),  # an iterable is read once, then reused per address
    )
    await stream.aclose()
    assert asked == [("hook.test", receiver.port)]
    assert [(d.host, d.port) for d in backend.dials] == [
        ("127.0.0.3", receiver.port),
        ("127.0.0.2", receiver.port),
    ]
    first, second = (d.timeout for d in backend.dials)
    assert first is not None and second is not None
    assert 0 < second <= first <= 0.5  # what is left of the one deadline, never more
    assert [d.local_address for d in backend.dials] == ["127.0.0.1", "127.0.0.1"]
    assert [d.socket_options for d in backend.dials] == [options, options]


async def test_without_a_connect_timeout_no_deadline_is_imposed(
    start_receiver: StartReceiver,
) -> None:
    receiver = await start_receiver("127.0.0.2")
    resolve, _ = answers(["127.0.0.2"])
    backend = RecordingBackend()
    guard = GuardedNetworkBackend(
        AddressPolicy(["127.0.0.2/32"]), resolver=resolve, backend=backend
    )
    stream = await guard.connect_tcp("hook.test", receiver.port, timeout=None)
    await stream.aclose()
    assert [(d.timeout, d.local_address, d.socket_options) for d in backend.dials] == [
        (None, None, None)
    ]


async def test_when_no_checked_address_answers_the_error_is_a_connect_error() -> None:
    with refusing_port("127.0.0.2") as port:
        resolve, _ = answers(["127.0.0.2"])
        http, backend = client(allowed=["127.0.0.2/32"], resolver=resolve)
        async with http:
            with pytest.raises(httpx.ConnectError):  # retryable: nothing was sent
                await http.get(f"http://hook.test:{port}/")
    assert backend.dialled == ["127.0.0.2"]


async def test_sleep_is_the_dialling_backends() -> None:
    backend = RecordingBackend()
    await GuardedNetworkBackend(AddressPolicy(), backend=backend).sleep(0)
    assert backend.slept == [0]


async def test_a_unix_socket_refusal_names_the_path() -> None:
    with pytest.raises(AddressRefusedError) as caught:
        await GuardedNetworkBackend(AddressPolicy()).connect_unix_socket("/run/docker.sock")
    assert caught.value.address == "/run/docker.sock"
    assert caught.value.reason == "a Unix socket; webhooks are only sent over checked TCP"


async def test_a_scheme_other_than_http_is_refused_with_what_is_allowed() -> None:
    transport = build_guarded_transport(AddressPolicy(), backend=LoopbackOnlyBackend())
    with pytest.raises(InvalidEndpointURLError) as caught:
        await transport.handle_async_request(httpx.Request("GET", "ftp://example.com/x"))
    assert str(caught.value) == (
        "refusing to send to a 'ftp' URL; only http or https is allowed, fix the endpoint URL"
    )


Build = Callable[..., httpx.AsyncBaseTransport]
BUILDERS: dict[str, Build] = {"build_guarded_transport": build_guarded_transport}


def _guarded_transport(policy: AddressPolicy, **kw: Any) -> httpx.AsyncBaseTransport:
    from delivery.ssrf import GuardedTransport

    return GuardedTransport(policy, **kw)


BUILDERS["GuardedTransport"] = _guarded_transport


@pytest.mark.parametrize("build", sorted(BUILDERS))
async def test_defaults_send_plain_http_and_verify_certificates(
    build: str, start_receiver: StartReceiver, tmp_path: Path
) -> None:
    """Without arguments: http is allowed, and TLS certificates are verified (an untrusted
    certificate is a connect error); `verify=False` is the explicit way to skip that."""
    plain = await start_receiver("127.0.0.2")
    server_ctx, _ = tls_contexts("hook.test", tmp_path)
    tls = await start_receiver("127.0.0.2", tls=server_ctx)
    resolve, _ = answers(["127.0.0.2"])
    policy = AddressPolicy(["127.0.0.2/32"])
    wire = BUILDERS[build](policy, resolver=resolve, backend=LoopbackOnlyBackend())
    async with httpx.AsyncClient(transport=wire, timeout=5.0) as http:
        assert (await http.get(f"http://hook.test:{plain.port}/")).status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await http.get(f"https://hook.test:{tls.port}/")
    assert tls.requests == []
    unverified = BUILDERS[build](
        policy, resolver=resolve, backend=LoopbackOnlyBackend(), verify=False
    )
    async with httpx.AsyncClient(transport=unverified, timeout=5.0) as http:
        assert (await http.get(f"https://hook.test:{tls.port}/")).status_code == 200


@pytest.mark.parametrize("build", sorted(BUILDERS))
def test_the_guarded_pool_keeps_the_limits_and_speaks_http1_only(build: str) -> None:
    """The transport builds its own httpcore pool with the guard (ssrf.py says why): it
    must keep the configured limits (httpx's own defaults without any). httpcore has no
    public accessor for a pool's settings, so this test alone reads them."""
    from delivery.ssrf import GuardedTransport

    limits = httpx.Limits(max_connections=7, max_keepalive_connections=3, keepalive_expiry=11)
    default = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    policy = AddressPolicy()
    for given, expected in [(limits, limits), (None, default)]:
        wire = BUILDERS[build](policy, limits=given)
        assert isinstance(wire, GuardedTransport)
        assert wire.limits == expected
        pool = wire.pool
        assert isinstance(pool, httpcore.AsyncConnectionPool)
        assert isinstance(pool._network_backend, GuardedNetworkBackend)
        assert (
            pool._max_connections,
            pool._max_keepalive_connections,
            pool._keepalive_expiry,
        ) == (
            expected.max_connections,
            expected.max_keepalive_connections,
            expected.keepalive_expiry,
        )
        assert (pool._http1, pool._http2) == (True, False)


@contextlib.asynccontextmanager
async def scripted_server(reply: bytes | None, *, hang_up: bool = False) -> AsyncIterator[int]:
    """A server on 127.0.0.2 answering every request head with `reply`, then hanging up
    or waiting for the next request (None: never answers); yields its port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if reply is None:
                    await reader.read()  # until the client hangs up
                    break
                writer.write(reply)
                await writer.drain()
                if hang_up:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.2", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("reply", "expected", "cause"),
    [
        # cut short in the body: raised while the response stream is read
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
            httpx.RemoteProtocolError,
            httpcore.RemoteProtocolError,
        ),
        # no answer at all: raised by the request itself, as the most specific class
        (None, httpx.ReadTimeout, httpcore.ReadTimeout),
    ],
)
async def test_httpcore_errors_reach_the_caller_as_httpxs_own(
    reply: bytes | None, expected: type[httpx.HTTPError], cause: type[Exception]
) -> None:
    """The worker classifies httpx's exception classes; the transport maps httpcore's
    into them (the same table as httpx's own transport), keeping the original as cause."""
    resolve, _ = answers(["127.0.0.2"])
    http, _ = client(allowed=["127.0.0.2/32"], resolver=resolve)
    async with scripted_server(reply, hang_up=True) as port, http:
        with pytest.raises(httpx.HTTPError) as caught:
            await http.get(f"http://hook.test:{port}/", timeout=httpx.Timeout(5.0, read=0.2))
    assert type(caught.value) is expected
    assert type(caught.value.__cause__) is cause


async def test_the_transport_closes_its_pool_and_returns_abandoned_connections() -> None:
    """`async with` and `aclose` close the pooled connections; a response closed unread
    gives its connection back (with one connection allowed, the next request needs it)."""
    from delivery.ssrf import GuardedTransport

    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    resolve, _ = answers(["127.0.0.2"])
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    extensions = {"timeout": {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 0.5}}
    async with scripted_server(reply) as port:
        url = f"http://hook.test:{port}/"
        for closing in ("context", "aclose"):
            transport = GuardedTransport(
                AddressPolicy(["127.0.0.2/32"]),
                limits=one,
                resolver=resolve,
                backend=LoopbackOnlyBackend(),
            )
            async with transport as entered:
                assert entered is transport
                unread = await transport.handle_async_request(
                    httpx.Request("GET", url, extensions=extensions)
                )
                await unread.aclose()
                read = await transport.handle_async_request(
                    httpx.Request("GET", url, extensions=extensions)
                )
                assert await read.aread() == b"ok"
                assert len(transport.pool.connections) == 1
                if closing == "aclose":
                    await transport.aclose()
                    assert transport.pool.connections == []
            assert transport.pool.connections == []


async def test_guarded_resolver_results_are_what_the_wire_dials() -> None:
    from delivery.ssrf import GuardedResolver

    asked: list[tuple[str, int]] = []

    async def fake(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return {"v4.test": ["127.0.0.2"], "v6.test": ["::1"], "empty.test": []}[host]

    resolver = GuardedResolver(AddressPolicy(["127.0.0.2/32", "::1/128"]), resolver=fake)
    assert await resolver.resolve("v4.test", 8443) == ["127.0.0.2"]
    assert await resolver.resolve("v6.test", 80) == ["::1"]
    assert asked == [("v4.test", 8443), ("v6.test", 80)]
    with pytest.raises(OSError, match=r"^empty\.test has no addresses$"):
        await resolver.resolve("empty.test", 80)
    refusing = GuardedResolver(AddressPolicy(), resolver=fake)
    with pytest.raises(AddressRefusedError) as refused:
        await refusing.resolve("v4.test", 80)
    assert refused.value.reason == "a loopback address"


# -- the warning when an endpoint is saved (refusal_warning) ------------------------------

WILL_REFUSE = (
    "the SSRF guard will refuse every delivery to it (each one dead at once) unless "
    "OUTBOX_ALLOWED_NETWORKS includes that address"
)


async def test_saving_an_endpoint_on_a_refused_literal_warns() -> None:
    from delivery.ssrf import refusal_warning

    policy = AddressPolicy()
    assert await refusal_warning(policy, "http://127.0.0.1:8080/x") == (
        f"127.0.0.1 is a loopback address: {WILL_REFUSE}"
    )
    assert await refusal_warning(policy, "https://[::1]/x") == (
        f"::1 is a loopback address: {WILL_REFUSE}"
    )
    assert await refusal_warning(policy, "http://8.8.8.8/x") is None
    assert await refusal_warning(AddressPolicy(["127.0.0.0/8"]), "http://127.0.0.1/") is None


async def test_saving_an_endpoint_on_a_name_warns_with_what_it_resolves_to() -> None:
    from delivery.ssrf import refusal_warning

    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return {"bad.test": ["8.8.8.8", "10.0.0.5"], "good.test": ["8.8.8.8"]}[host]

    policy = AddressPolicy()
    assert await refusal_warning(policy, "http://bad.test/x", resolver=resolve) == (
        f"bad.test resolves to 10.0.0.5, which is a private address (RFC 1918): {WILL_REFUSE}"
    )
    assert await refusal_warning(policy, "https://good.test/x", resolver=resolve) is None
    assert await refusal_warning(policy, "https://good.test:8443/", resolver=resolve) is None
    assert asked == [("bad.test", 80), ("good.test", 443), ("good.test", 8443)]


async def test_no_warning_when_nothing_can_be_said() -> None:
    """Not a URL, no host, a name that does not resolve or resolves too slowly: the
    guard decides at send time (a DNS failure is retried), so saving is not warned."""
    from delivery.ssrf import refusal_warning

    async def private(host: str, port: int) -> list[str]:
        return ["10.0.0.5"]

    async def fails(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    never = asyncio.Event()

    async def hangs(host: str, port: int) -> list[str]:
        await never.wait()
        raise AssertionError("unreachable")

    policy = AddressPolicy()
    assert await refusal_warning(policy, "http://[::1", resolver=private) is None
    assert await refusal_warning(policy, "/relative/path", resolver=private) is None
    assert await refusal_warning(policy, "http://gone.test/", resolver=fails) is None
    slow = refusal_warning(policy, "http://slow.test/", resolver=hangs, resolve_seconds=0.01)
    assert await asyncio.wait_for(slow, 5) is None


async def test_the_warning_waits_three_seconds_for_dns_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Saving an endpoint waits at most 3 s for its name to resolve (then saves without
    advice). Pinned through the timeout handed to asyncio.wait_for: a real 3 s wait
    would slow the suite for a constant."""
    from delivery import ssrf

    timeouts: list[float | None] = []
    real_wait_for = asyncio.wait_for

    # asyncio.wait_for's own signature, hence a `timeout` parameter
    async def recording_wait_for(
        awaitable: Awaitable[Any],
        timeout: float | None,  # noqa: ASYNC109
    ) -> Any:
        timeouts.append(timeout)
        return await real_wait_for(awaitable, timeout)

    async def public(host: str, port: int) -> list[str]:
        return ["8.8.8.8"]

    monkeypatch.setattr(asyncio, "wait_for", recording_wait_for)
    assert await ssrf.refusal_warning(AddressPolicy(), "http://n.test/", resolver=public) is None
    assert timeouts == [3.0]
