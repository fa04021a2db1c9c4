"""Connecting for the wire: checked targets, Happy Eyeballs, and tunnels through a proxy."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import re
import ssl
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

import httpx
from yarl import URL

from delivery.ssrf import GuardedResolver, Resolver
from delivery.wire.connection import _Connection, _Pool
from outbox.endpoint_auth import ClientCertificate
from outbox.urls import ProxyURL

# Client-certificate TLS contexts kept per transport (one per endpoint certificate in use).
_MAX_IDENTITY_CONTEXTS = 1024
# A name's checked addresses are reused this long for new connections (aiohttp's default).
_DNS_TTL_SECONDS = 10.0
# Happy Eyeballs (RFC 8305): the next address is tried this long after the previous one
# started, while that one keeps trying; the first connection up wins.
CONNECT_STAGGER_SECONDS = 0.25
# A proxy's answer to CONNECT larger than this is refused (it is a status line and a few
# headers).
_MAX_PROXY_HEAD = 16 * 1024
_PROXY_STATUS = re.compile(rb"^HTTP/1\.[01] ([0-9]{3})(?: ([^\r\n]*))?\r\n")
T = TypeVar("T")


class _Target:
    """An endpoint URL, parsed and checked once: where to connect and what to send.

    Through a proxy (`proxy` set) it pools apart from direct connections (`key` names
    the proxy and a digest of its credentials); a plain-HTTP request goes to the proxy in
    absolute form (`at` an address the guard checked) with `proxy_lines` in its head.
    """

    __slots__ = (
        "_at",
        "host",
        "host_header",
        "identity",
        "key",
        "literal",
        "path",
        "port",
        "proxy",
        "proxy_lines",
        "tls",
    )

    def __init__(self, url: URL, proxy: ProxyURL | None = None) -> None:
        self.host = url.raw_host or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.tls = url.scheme == "https"
        self.key = (self.tls, self.host, self.port)
        self.literal = _is_ip_literal(self.host)
        bracketed = f"[{self.host}]" if ":" in self.host else self.host
        default_port = 443 if self.tls else 80
        self.host_header = bracketed if self.port == default_port else f"{bracketed}:{self.port}"
        self.path = (url.raw_path_qs or "/").encode("ascii")
        self.proxy = proxy
        self.proxy_lines = ""
        self.identity: ClientCertificate | None = None
        self._at: dict[str, _Target] = {}
        if proxy is not None:
            credentials = f"{proxy.username}:{proxy.password}".encode()
            via = f"{proxy.display}#{hashlib.sha256(credentials).hexdigest()[:16]}"
            self.key = (self.tls, f"{self.host} via {via}", self.port)
            if not self.tls and proxy.authorization is not None:
                self.proxy_lines = f"Proxy-Authorization: {proxy.authorization}\r\n"
            if not self.tls and self.literal:
                self.path = _absolute(self.host, self.port, self.path)

    def at(self, address: str) -> _Target:
        """This plain-HTTP target through its proxy, addressed to a checked `address`: the
        proxy connects where the guard said, not where its own DNS says."""
        found = self._at.get(address)
        if found is None:
            if len(self._at) > 64:
                self._at.clear()
            found = self._at[address] = _copy_target(self)
            found.path = _absolute(address, self.port, self.path)
        return found

    def presenting(self, identity: ClientCertificate) -> _Target:
        """This HTTPS target presenting `identity` (mutual TLS): it pools apart, under
        the certificate's version, so a connection made with one endpoint's certificate
        is never reused for another's (or for a request with none)."""
        found = _copy_target(self)
        found.identity = identity
        found.key = (self.tls, f"{self.key[1]} as {identity.version}", self.port)
        return found


def _copy_target(target: _Target) -> _Target:
    copied = object.__new__(_Target)
    for name in _Target.__slots__:
        setattr(copied, name, getattr(target, name))
    copied._at = {}
    return copied


def _absolute(address: str, port: int, path: bytes) -> bytes:
    """The absolute-form request target (RFC 9112 3.2.2) a proxy forwards."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}".encode("ascii") + path


class _TunnelHandshake(asyncio.Protocol):
    """Reads a proxy's answer to CONNECT (a status line and headers), nothing more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self.early = False  # bytes came after the head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            self.early = True
            return
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end >= 0:
            # A refusal may carry a body; after a 200, the tunnel's first bytes are the
            # server's, and a server speaks only after our TLS hello.
            self.early = len(self._buffer) > end + 4
            self.head.set_result(bytes(self._buffer[: end + 4]))
            self.transport.pause_reading()  # type: ignore[union-attr]
        elif len(self._buffer) > _MAX_PROXY_HEAD:
            self.head.set_exception(
                ConnectionError(f"the proxy's answer to CONNECT is over {_MAX_PROXY_HEAD} bytes")
            )

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(
                ConnectionError(f"the proxy closed the connection during CONNECT ({exc})")
            )


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Connecting:
    """How `WireTransport` opens a connection: direct, raced over a name's checked
    addresses, or through a proxy (its state lives on the transport)."""

    _pool: _Pool
    _resolver: GuardedResolver
    _ssl_context: ssl.SSLContext | None
    _tls_factory: Callable[[], ssl.SSLContext]
    _identity_contexts: dict[str, ssl.SSLContext]
    _addresses: dict[tuple[str, int], tuple[float, list[str]]]
    _proxy_resolver: Resolver
    _stagger: float

    async def _connect(self, target: _Target) -> _Connection:
        if target.proxy is not None:
            return await self._connect_through_proxy(target, target.proxy)
        loop = asyncio.get_running_loop()
        addresses = [target.host] if target.literal else await self._resolve(target)
        tls = self._tls_context(target.identity) if target.tls else None

        async def open_one(address: str) -> _Connection:
            _, connection = await loop.create_connection(
                lambda: _Connection(self._pool, target.key),
                address,
                target.port,
                ssl=tls,
                server_hostname=target.host if tls is not None else None,
            )
            return connection

        return await self._first_to_connect(
            addresses, open_one, f"{target.host}:{target.port}", _close_connection
        )

    async def _first_to_connect(
        self,
        addresses: Sequence[str],
        open_one: Callable[[str], Coroutine[Any, Any, T]],
        what: str,
        discard: Callable[[T], None],
    ) -> T:
        """Happy Eyeballs (RFC 8305 section 5): the first address gets `self._stagger`
        seconds before the next one starts beside it (at once when it fails), and so on;
        the first connection up (TCP and TLS) wins and the others are cancelled. A
        blackholed first address costs a stagger, not the whole deadline.

        Only OSError and TLS failures move on to the next address; anything else (the
        guard's refusal, a proxy's answer) propagates. Losers that connected anyway are
        handed to `discard`."""
        failures: list[str] = []
        running: dict[asyncio.Task[T], str] = {}
        remaining = list(addresses)
        try:
            while remaining or running:
                if remaining:
                    address = remaining.pop(0)
                    running[asyncio.create_task(open_one(address))] = address
                done, _ = await asyncio.wait(
                    running,
                    timeout=self._stagger if remaining else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    address = running.pop(task)
                    error = task.exception()
                    if error is None:
                        return task.result()
                    if not isinstance(error, (OSError, ssl.SSLError)):
                        raise error
                    failures.append(f"{address}: {error}")
        finally:
            for task in running:
                task.cancel()
            for outcome in await asyncio.gather(*running, return_exceptions=True):
                if not isinstance(outcome, BaseException):
                    discard(outcome)  # a loser that connected anyway
        raise httpx.ConnectError(f"cannot connect to {what} ({'; '.join(failures)})")

    async def _connect_through_proxy(self, target: _Target, proxy: ProxyURL) -> _Connection:
        """A connection to the proxy; for HTTPS, a `CONNECT` tunnel to an address the guard
        checked, with TLS for the URL's host on top."""
        loop = asyncio.get_running_loop()
        if _is_ip_literal(proxy.host):
            proxy_addresses: Sequence[str] = [proxy.host]
        else:
            try:
                proxy_addresses = await self._proxy_resolver(proxy.host, proxy.port)
            except OSError as exc:
                raise httpx.ConnectError(
                    f"cannot resolve the proxy {proxy.display}: {exc}"
                ) from exc
        where = f"the proxy {proxy.display}"
        if not target.tls:

            async def open_plain(address: str) -> _Connection:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._pool, target.key), address, proxy.port
                )
                return connection

            return await self._first_to_connect(
                proxy_addresses, open_plain, where, _close_connection
            )
        checked = [target.host] if target.literal else await self._resolve(target)
        tls_context = self._tls_context(target.identity)

        async def open_tunnel(proxy_address: str) -> _TunnelHandshake:
            _, handshake = await loop.create_connection(_TunnelHandshake, proxy_address, proxy.port)
            return handshake

        async def through(address: str) -> _Connection:
            """CONNECT to one checked address, then TLS for the URL's host. A refusal of
            this address (or TLS failing) moves on to the next; an unreachable proxy or
            refused credentials end the attempt."""
            handshake = await self._first_to_connect(
                proxy_addresses, open_tunnel, where, _close_handshake
            )
            try:
                status, reason = await self._tunnel(handshake, proxy, address, target.port)
                if status in (401, 407):  # tinyproxy answers wrong credentials with 401
                    raise httpx.ConnectError(_proxy_auth_refused(proxy, status, reason))
                if status != 200:
                    raise ConnectionRefusedError(
                        f"{where} refused CONNECT ({status} {reason}); check its allowed "
                        "ports (e.g. tinyproxy's ConnectPort)"
                    )
                connection = _Connection(self._pool, target.key)
                assert handshake.transport is not None
                tls = await loop.start_tls(
                    handshake.transport, connection, tls_context, server_hostname=target.host
                )
                if tls is None:  # pragma: no cover - only a server-side start_tls returns None
                    raise ConnectionError("TLS did not start")
            except BaseException:
                _close_handshake(handshake)
                raise
            connection.connection_made(tls)
            return connection

        return await self._first_to_connect(
            checked, through, f"{target.host}:{target.port} through {where}", _close_connection
        )

    async def _tunnel(
        self, handshake: _TunnelHandshake, proxy: ProxyURL, address: str, port: int
    ) -> tuple[int, str]:
        """Ask the proxy to `CONNECT` to `address` (checked by the guard); its status."""
        authority = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        authorization = proxy.authorization
        request = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n" + (
            f"Proxy-Authorization: {authorization}\r\n" if authorization else ""
        )
        assert handshake.transport is not None
        handshake.transport.write(request.encode("latin-1") + b"\r\n")
        try:
            head = await handshake.head
        except ConnectionError as exc:
            handshake.transport.abort()
            raise httpx.ConnectError(f"{exc} (the proxy {proxy.display})") from exc
        matched = _PROXY_STATUS.match(head)
        if matched is None:
            handshake.transport.abort()
            raise httpx.ConnectError(
                f"the proxy {proxy.display} answered CONNECT with something that is not HTTP/1.1"
            )
        reason = (matched.group(2) or b"").decode("latin-1")[:100]
        status = int(matched.group(1))
        if status == 200 and handshake.early:
            handshake.transport.abort()
            raise httpx.ConnectError(
                f"the proxy {proxy.display} sent bytes into the tunnel before TLS started"
            )
        return status, " ".join(reason.split())

    async def _resolve(self, target: _Target) -> list[str]:
        """The name's addresses, each checked by the SSRF guard (refused: AddressRefusedError)."""
        key = (target.host, target.port)
        cached = self._addresses.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _DNS_TTL_SECONDS:
            return cached[1]
        try:
            answers = await self._resolver.resolve(target.host, target.port)
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {target.host}: {exc}") from exc
        addresses = list(answers)
        if len(self._addresses) > 10_000:
            self._addresses.clear()
        self._addresses[key] = (now, addresses)
        return addresses

    def _tls_context(self, identity: ClientCertificate | None = None) -> ssl.SSLContext:
        """The client TLS context, built on first use (most workers send to few hosts);
        with `identity`, a context of its own presenting that certificate, cached under
        its version (a new certificate for the endpoint gets a new context)."""
        if identity is not None:
            found = self._identity_contexts.get(identity.version)
            if found is None:
                found = _with_client_certificate(self._tls_factory(), identity)
                if len(self._identity_contexts) >= _MAX_IDENTITY_CONTEXTS:
                    self._identity_contexts.clear()
                self._identity_contexts[identity.version] = found
            return found
        if self._ssl_context is None:
            self._ssl_context = self._tls_factory()
        return self._ssl_context


def _with_client_certificate(
    context: ssl.SSLContext, identity: ClientCertificate
) -> ssl.SSLContext:
    """`context` presenting `identity`. `load_cert_chain` reads only files, so the PEM goes
    to a 0600 file in a private (0700) temporary directory, removed as soon as it is read;
    a pair the ssl module refuses becomes a clear connect error, not a crash."""
    with tempfile.TemporaryDirectory(prefix="outbox-mtls-") as private:
        path = os.path.join(private, "identity.pem")
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(identity.key_pem + "\n" + identity.certificate_pem)
            context.load_cert_chain(path)
        except (ssl.SSLError, ValueError) as exc:
            raise httpx.ConnectError(
                f"the endpoint's client certificate cannot be used for TLS ({exc}); set it "
                "again with `outbox endpoints set-auth`"
            ) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return context


def _close_connection(connection: _Connection) -> None:
    connection.close()


def _close_handshake(handshake: _TunnelHandshake) -> None:
    if handshake.transport is not None:
        handshake.transport.abort()


def _proxy_auth_refused(proxy: ProxyURL, status: int, reason: str) -> str:
    """What a 407 (or 401) from the proxy means here, without the credentials."""
    answer = f"{status} {reason}".strip()
    if proxy.authorization is None:
        return (
            f"the proxy {proxy.display} requires credentials ({answer}); put them in the "
            "proxy URL: http://user:password@host:port"
        )
    return (
        f"the proxy {proxy.display} refused the credentials in the proxy URL ({answer}); "
        "fix the user name or password"
    )
