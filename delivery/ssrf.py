"""SSRF guard: webhooks only go to addresses an operator would expect.

Endpoint URLs come from people outside the trust boundary, so a URL such as
`http://169.254.169.254/` or a name that resolves to `10.0.0.5` must not turn the
worker into a proxy into the private network. Checking the URL when it is saved
is not enough: DNS can answer differently later (DNS rebinding), and numeric
spellings such as `2130706433` or `0x7f000001` hide `127.0.0.1`. So the check
happens at connect time, inside the httpcore network backend:

1. resolve the host once (`loop.getaddrinfo`, which also turns every numeric
   spelling into a canonical address),
2. check every A/AAAA answer against the `AddressPolicy` and refuse the whole
   connection if any one is refused (an attacker controls the order of answers),
3. dial the checked IP literal itself, so nothing resolves the name a second
   time; TLS still verifies and sends SNI for the original hostname, because
   httpcore passes that name to `start_tls`, and the Host header comes from the URL.

A refused address raises `AddressRefusedError`, which `GuardedTransport` passes
through unchanged (it maps only httpcore's own exception classes to httpx's), so the
worker can classify it as a PERMANENT failure. DNS failures and timeouts surface as
`httpx.ConnectError` / `httpx.ConnectTimeout`: retryable, nothing was sent.

`validate_endpoint_url` is the cheap, DNS-free check for when an endpoint is
saved; it gives the operator a clear message early, the connect-time check is
the one that enforces.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from types import TracebackType
from typing import Final, Generic, Self, TypeVar

import httpcore
import httpx
from yarl import URL

from delivery.errors import AddressRefusedError, DeliveryConfigurationError, InvalidEndpointURLError
from outbox.urls import MAX_URL_LENGTH, validate_endpoint_url

__all__ = [
    "MAX_URL_LENGTH",
    "AddressPolicy",
    "CheckedURLs",
    "GuardedNetworkBackend",
    "GuardedTransport",
    "Resolver",
    "build_guarded_transport",
    "check_outgoing_url",
    "normalise_address",
    "system_resolver",
    "validate_endpoint_url",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""`(host, port) -> addresses`: every address the host resolves to, as IP literals."""


def _nets(*entries: tuple[str, str]) -> tuple[tuple[IPNetwork, str], ...]:
    return tuple((ipaddress.ip_network(cidr), reason) for cidr, reason in entries)


# Refused unless an allowed network says otherwise. Our own table rather than
# `ipaddress.is_global`/`is_private`, whose answers changed between Python releases;
# more specific entries come first so the reason names the most useful range.
_REFUSED_V4: Final = _nets(
    ("169.254.169.254/32", "the cloud instance metadata service (link-local)"),
    ("0.0.0.0/32", "the unspecified address"),
    ("0.0.0.0/8", "'this network' (0.0.0.0/8)"),
    ("10.0.0.0/8", "a private address (RFC 1918)"),
    ("100.64.0.0/10", "carrier-grade NAT shared space (RFC 6598)"),
    ("127.0.0.0/8", "a loopback address"),
    ("169.254.0.0/16", "a link-local address"),
    ("172.16.0.0/12", "a private address (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments (RFC 6890)"),
    ("192.0.2.0/24", "a documentation address (TEST-NET-1)"),
    ("192.88.99.0/24", "the deprecated 6to4 relay anycast range (RFC 7526)"),
    ("192.168.0.0/16", "a private address (RFC 1918)"),
    ("198.18.0.0/15", "a benchmarking address (RFC 2544)"),
    ("198.51.100.0/24", "a documentation address (TEST-NET-2)"),
    ("203.0.113.0/24", "a documentation address (TEST-NET-3)"),
    ("224.0.0.0/4", "a multicast address"),
    ("255.255.255.255/32", "the broadcast address"),
    ("240.0.0.0/4", "reserved (240.0.0.0/4)"),
)
_REFUSED_V6: Final = _nets(
    ("::/128", "the unspecified address"),
    ("::1/128", "a loopback address"),
    ("::ffff:0:0/96", "an IPv4-mapped address"),
    ("64:ff9b:1::/48", "local-use NAT64 (RFC 8215)"),
    ("100::/64", "the discard-only prefix (RFC 6666)"),
    ("2001:db8::/32", "a documentation address"),
    ("3fff::/20", "a documentation address (RFC 9637)"),
    ("2001:2::/48", "a benchmarking address (RFC 5180)"),
    ("2001:10::/28", "deprecated ORCHID space"),
    ("fd00:ec2::254/128", "the AWS instance metadata service"),
    ("fc00::/7", "a unique local (private) address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address (deprecated)"),
    ("ff00::/8", "a multicast address"),
)
_SIX_TO_FOUR: Final = ipaddress.IPv6Network("2002::/16")
_TEREDO: Final = ipaddress.IPv6Network("2001::/32")
_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")
_GLOBAL_UNICAST_V6: Final = ipaddress.IPv6Network("2000::/3")


def normalise_address(value: str | IPAddress) -> IPAddress:
    """Parse an IP literal; IPv4-mapped IPv6 (`::ffff:127.0.0.1`) becomes plain IPv4.

    The operating system routes a mapped address to its IPv4 host, so it must be
    judged (and dialled) as that IPv4 address. Raises `AddressRefusedError` for
    anything that is not an IP literal: the guard never lets a name through.
    """
    if isinstance(value, str):
        try:
            address: IPAddress = ipaddress.ip_address(value)
        except ValueError:
            raise AddressRefusedError(
                value, "not an IP address (the guard only dials resolved literals)"
            ) from None
    else:
        address = value
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class AddressPolicy:
    """Which IP addresses webhook deliveries may connect to.

    Public unicast addresses are allowed; every special-purpose range is refused
    unless it lies inside one of `allowed_networks` (OUTBOX_ALLOWED_NETWORKS), for
    example `127.0.0.0/8` in tests or `10.20.0.0/16` for an internal receiver.
    """

    def __init__(self, allowed_networks: Iterable[str] = ()) -> None:
        self.allowed_networks: tuple[IPNetwork, ...] = tuple(
            _parse_allowed_network(entry) for entry in allowed_networks
        )

    def __repr__(self) -> str:
        return f"AddressPolicy({[str(net) for net in self.allowed_networks]!r})"

    def check(self, ip: str | IPAddress) -> None:
        """Return if `ip` may be dialled, else raise `AddressRefusedError` saying why."""
        address = normalise_address(ip)
        reason = self._refusal(address)
        if reason is not None:
            raise AddressRefusedError(str(address), reason)

    def _refusal(self, address: IPAddress) -> str | None:
        if any(address in net for net in self.allowed_networks):
            return None
        if isinstance(address, ipaddress.IPv4Address):
            return _first_reason(address, _REFUSED_V4)
        reason = _first_reason(address, _REFUSED_V6)
        if reason is not None:
            return reason
        for kind, embedded in _embedded_ipv4(address):
            inner = self._refusal(embedded)
            if inner is not None:
                return f"a {kind} address that embeds {embedded}, which is {inner}"
        if address not in _GLOBAL_UNICAST_V6 and address not in _NAT64:
            return "reserved IPv6 space (outside global unicast 2000::/3)"
        return None


def _first_reason(address: IPAddress, table: tuple[tuple[IPNetwork, str], ...]) -> str | None:
    return next((reason for net, reason in table if address in net), None)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """IPv4 addresses a transition mechanism would actually deliver to."""
    if address in _SIX_TO_FOUR and address.sixtofour is not None:
        return [("6to4", address.sixtofour)]
    if address in _TEREDO and address.teredo is not None:
        server, client = address.teredo
        return [("Teredo", client), ("Teredo", server)]
    if address in _NAT64:
        return [("NAT64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))]
    return []


def _parse_allowed_network(entry: str) -> IPNetwork:
    text = entry.strip()
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        hint = ""
        with contextlib.suppress(ValueError):
            hint = f"; did you mean {ipaddress.ip_network(text, strict=False)}?"
        raise DeliveryConfigurationError(
            f"OUTBOX_ALLOWED_NETWORKS entry {entry!r} is not a network in CIDR form "
            f"such as 10.20.0.0/16 or fd12:3456::/48 ({exc}){hint}"
        ) from None
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(
        ipaddress.IPv6Network("::ffff:0:0/96")
    ):
        raise DeliveryConfigurationError(
            f"OUTBOX_ALLOWED_NETWORKS entry {entry!r} is IPv4-mapped IPv6; addresses are "
            "checked as plain IPv4, so write the IPv4 network instead"
        )
    return network


async def system_resolver(host: str, port: int) -> list[str]:
    """Every TCP address of `host`, in the order the system resolver returns them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore backend that resolves, checks and then dials the checked IP literal.

    Requires asyncio (it resolves with `loop.getaddrinfo`). `backend` does the
    actual dialling and TLS and defaults to httpcore's own `AnyIOBackend`.
    """

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        resolver: Resolver | None = None,
        backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._policy = policy
        self._resolve: Resolver = resolver or system_resolver
        self._backend = backend or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's backend interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        addresses = await self._resolve_and_check(host, port, timeout)
        options = None if socket_options is None else list(socket_options)
        failure: httpcore.ConnectError | None = None
        for address in addresses:
            remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                return await self._backend.connect_tcp(
                    str(address),
                    port,
                    timeout=remaining,
                    local_address=local_address,
                    socket_options=options,
                )
            except httpcore.ConnectError as exc:
                # Try the next checked address, as a resolving connect would; a
                # ConnectTimeout propagates because the one deadline is spent.
                failure = exc
        assert failure is not None
        raise failure

    async def _resolve_and_check(
        self, host: str, port: int, limit: float | None
    ) -> list[IPAddress]:
        """All of `host`'s addresses, each checked; one refused address refuses them all."""
        try:
            async with asyncio.timeout(limit):
                answers = await self._resolve(host, port)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(
                f"resolving {host!r} took longer than the {limit}s connect timeout"
            ) from exc
        except OSError as exc:
            raise httpcore.ConnectError(f"could not resolve {host!r}: {exc}") from exc
        if not answers:
            raise httpcore.ConnectError(f"{host!r} resolved to no addresses")
        checked: list[IPAddress] = []
        for answer in answers:
            try:
                address = normalise_address(answer)
                self._policy.check(address)
            except AddressRefusedError as exc:
                raise AddressRefusedError(exc.address, exc.reason, host=host) from None
            checked.append(address)
        return checked

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's backend interface
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise AddressRefusedError(path, "a Unix socket; webhooks are only sent over checked TCP")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


# httpcore exception -> the httpx exception httpx's own transport raises for it, so a
# caller (and `send_attempt`) sees the same classes whichever transport is used. The
# same table as httpx's `map_httpcore_exceptions` (httpx 0.28), which is not public.
_HTTPCORE_TO_HTTPX: Final[dict[type[Exception], type[httpx.HTTPError]]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


@contextlib.contextmanager
def _httpx_exceptions() -> Iterator[None]:
    """Translate httpcore's exceptions into httpx's, the most specific class that fits.

    Anything else (`AddressRefusedError` above all) passes through unchanged, so the
    worker can classify a refusal as permanent.
    """
    try:
        yield
    except Exception as exc:
        mapped: type[httpx.HTTPError] | None = None
        for source, target in _HTTPCORE_TO_HTTPX.items():
            if isinstance(exc, source) and (mapped is None or issubclass(target, mapped)):
                mapped = target
        if mapped is None:
            raise
        raise mapped(str(exc)) from exc


class _GuardedResponseStream(httpx.AsyncByteStream):
    """httpcore's response body as an httpx stream, with httpcore's exceptions mapped."""

    def __init__(self, stream: AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_exceptions():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        close = getattr(self._stream, "aclose", None)
        if close is not None:
            await close()


class GuardedTransport(httpx.AsyncBaseTransport):
    """An httpx transport over httpcore's pool whose every connection goes through the
    SSRF guard.

    Why not subclass `httpx.AsyncHTTPTransport`: httpx 0.28 has no public way to give
    it a network backend (proposed in encode/httpx#3749), and swapping its private pool
    breaks silently on an httpx release. So this owns an `httpcore.AsyncConnectionPool`
    built with `GuardedNetworkBackend` (httpcore's public API) and does the little
    httpx's transport does around it: convert the request and response, map httpcore's
    exceptions to httpx's, close the pool.

    No proxy, no Unix socket, no environment: a proxy would make the guard check the
    proxy's address instead of the receiver's.
    """

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        https_only: bool = False,
        verify: ssl.SSLContext | bool = True,
        limits: httpx.Limits | None = None,
        resolver: Resolver | None = None,
        backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.https_only = https_only
        self.limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
        ssl_context = verify if isinstance(verify, ssl.SSLContext) else _ssl_context(verify)
        self.pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=self.limits.max_connections,
            max_keepalive_connections=self.limits.max_keepalive_connections,
            keepalive_expiry=self.limits.keepalive_expiry,
            http1=True,
            http2=False,
            network_backend=GuardedNetworkBackend(policy, resolver=resolver, backend=backend),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        allowed = ("https",) if self.https_only else ("http", "https")
        if request.url.scheme not in allowed:
            raise InvalidEndpointURLError(
                f"refusing to send to a {request.url.scheme!r} URL; only "
                f"{' or '.join(allowed)} is allowed, fix the endpoint URL"
            )
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_exceptions():
            core_response = await self.pool.handle_async_request(core_request)
        assert isinstance(core_response.stream, AsyncIterable)
        return httpx.Response(
            status_code=core_response.status,
            headers=core_response.headers,
            stream=_GuardedResponseStream(core_response.stream),
            extensions=core_response.extensions,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def __aenter__(self) -> Self:
        await self.pool.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        with _httpx_exceptions():
            await self.pool.__aexit__(exc_type, exc_value, traceback)


def _ssl_context(verify: bool) -> ssl.SSLContext:
    return httpx.create_ssl_context(verify=verify)


def build_guarded_transport(
    policy: AddressPolicy,
    *,
    https_only: bool = False,
    verify: ssl.SSLContext | bool = True,
    limits: httpx.Limits | None = None,
    resolver: Resolver | None = None,
    backend: httpcore.AsyncNetworkBackend | None = None,
) -> httpx.AsyncBaseTransport:
    """The transport the worker's `httpx.AsyncClient` must use for every delivery.

    Use it with `follow_redirects=False` (httpx's default): a 3xx is an outcome to
    record. Even if redirects were followed, each hop would connect through the
    guard and be refused the same way.
    """
    return GuardedTransport(
        policy,
        https_only=https_only,
        verify=verify,
        limits=limits,
        resolver=resolver,
        backend=backend,
    )


class GuardedResolver:
    """The SSRF guard for the wire: a host is refused if any of its addresses is refused.

    The wire dials exactly the addresses this returns, so checking them here checks
    the address actually dialled, as the httpcore backend above does. IP literals
    never reach a resolver; `check_literal_host` covers those.
    """

    def __init__(self, policy: AddressPolicy, resolver: Resolver | None = None) -> None:
        self._policy = policy
        self._resolve = resolver or system_resolver

    async def resolve(self, host: str, port: int) -> list[str]:
        """`host`'s addresses as canonical IP literals, each checked; OSError when none."""
        answers = [normalise_address(answer) for answer in await self._resolve(host, port)]
        if not answers:
            raise OSError(f"{host} has no addresses")
        for address in answers:
            try:
                self._policy.check(address)
            except AddressRefusedError as exc:
                raise AddressRefusedError(exc.address, exc.reason, host=host) from None
        return [str(address) for address in answers]


def check_outgoing_url(policy: AddressPolicy, url: URL, *, https_only: bool) -> None:
    """What the fast wires check before any connection: the scheme rule, and the guard
    for a host that is an IP literal (no resolver sees those)."""
    allowed = ("https",) if https_only else ("http", "https")
    if url.scheme not in allowed:
        raise InvalidEndpointURLError(
            f"refusing to send to a {url.scheme!r} URL; only "
            f"{' or '.join(allowed)} is allowed, fix the endpoint URL"
        )
    if not url.raw_host:
        raise InvalidEndpointURLError(f"the endpoint URL {str(url)!r} has no host")
    check_literal_host(policy, url.raw_host)


T = TypeVar("T")


class CheckedURLs(Generic[T]):
    """Outgoing URLs parsed and checked (`check_outgoing_url`) once each, kept as `build`
    makes them from the parsed URL. Bounded: a worker sends to few distinct URLs, but
    nothing stops a caller from sending to many."""

    def __init__(
        self, policy: AddressPolicy, *, https_only: bool, build: Callable[[URL], T]
    ) -> None:
        self._policy = policy
        self._https_only = https_only
        self._build = build
        self._found: dict[str, T] = {}

    def get(self, url: str) -> T:
        found = self._found.get(url)
        if found is None:
            parsed = URL(url)
            check_outgoing_url(self._policy, parsed, https_only=self._https_only)
            if len(self._found) > 10_000:
                self._found.clear()
            found = self._found[url] = self._build(parsed)
        return found


def check_literal_host(policy: AddressPolicy, host: str) -> None:
    """Apply the guard to a URL whose host is an IP literal (no resolver sees those)."""
    literal = host.strip("[]")
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        return  # a name: the resolver checks every address it resolves to
    policy.check(literal)


async def refusal_warning(
    policy: AddressPolicy,
    url: str,
    *,
    resolver: Resolver | None = None,
    resolve_seconds: float = 3.0,
) -> str | None:
    """Why deliveries to `url` would be refused today, or None: a warning when it is saved.

    The same policy the connect-time guard applies, to the addresses the name resolves
    to now. Only advice: DNS may answer differently when something is sent, and the
    guard decides then. A name that does not resolve at all is not a refusal (the
    worker retries a DNS failure), so it gets no warning here.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return None
    host = parsed.host
    if not host:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    literal = host.strip("[]")
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        literal = ""
    try:
        if literal:
            addresses: Sequence[str] = [literal]
        else:
            lookup = resolver or system_resolver
            addresses = await asyncio.wait_for(lookup(host, port), resolve_seconds)
    except (OSError, TimeoutError):
        return None
    for address in addresses:
        try:
            policy.check(address)
        except AddressRefusedError as exc:
            where = host if literal else f"{host} resolves to {exc.address}, which"
            return (
                f"{where} is {exc.reason}: the SSRF guard will refuse every delivery to it "
                "(each one dead at once) unless OUTBOX_ALLOWED_NETWORKS includes that address"
            )
    return None
