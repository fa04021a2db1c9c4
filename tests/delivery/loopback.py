"""Raw receivers on loopback that the SSRF, wire and proxy tests share.

`Receiver` is a tiny HTTP/1.1 server (plain or TLS) that records each request; the
`start_receiver` fixture (tests/delivery/conftest.py) starts them and stops them after
the test. `answers` is an injected resolver, `blackhole` an address that never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A tiny HTTP/1.1 server: records each request, answers with a fixed response."""

    host: str
    port: int = 0
    status: int = 200
    response_headers: dict[str, str] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, target, _ = request_line.split(" ", 2)
            headers = {}
            for line in lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            body = await reader.readexactly(length) if length else b""
            self.requests.append(Request(method, target, headers, body))
            extra = "".join(f"{k}: {v}\r\n" for k, v in self.response_headers.items())
            writer.write(
                f"HTTP/1.1 {self.status} X\r\ncontent-length: 2\r\nconnection: close\r\n"
                f"{extra}\r\nok".encode()
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


StartReceiver = Callable[..., Awaitable[Receiver]]


def answers(*rounds: Sequence[str]) -> tuple[Callable[[str, int], Awaitable[list[str]]], list[str]]:
    """A resolver giving the n-th answer on the n-th call (the last one repeats)."""
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return list(rounds[min(len(asked), len(rounds)) - 1])

    return resolve, asked


def tls_contexts(hostname: str, directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts: a throwaway CA and a leaf valid only for `hostname`."""
    now = dt.datetime.now(dt.UTC)

    def build(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: str
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        build("test CA", ca_key, "test CA")
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        build(hostname, leaf_key, "test CA")
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server.load_cert_chain(cert_path, key_path)
    client_ctx = ssl.create_default_context(
        cadata=ca.public_bytes(serialization.Encoding.PEM).decode()
    )
    return server, client_ctx


async def tls_receiver_recording_sni(
    start_receiver: StartReceiver, directory: Path
) -> tuple[Receiver, ssl.SSLContext, list[str | None]]:
    """A TLS receiver on 127.0.0.2 for `hook.test`, a client context trusting it, and the
    server names (SNI) its handshakes were asked for."""
    server_ctx, client_ctx = tls_contexts("hook.test", directory)
    sni: list[str | None] = []

    def record_sni(_obj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        sni.append(name)

    server_ctx.sni_callback = record_sni
    return await start_receiver("127.0.0.2", tls=server_ctx), client_ctx, sni


@contextlib.contextmanager
def blackhole(host: str, port: int) -> Iterator[None]:
    """`host:port` accepts no connection and answers no SYN: a listener with backlog 0
    whose one queue slot is taken by a connection nobody accepts."""
    listener = socket.socket()
    filler = socket.socket()
    try:
        listener.bind((host, port))
        listener.listen(0)
        filler.connect((host, port))
        probe = socket.socket()
        probe.settimeout(0.3)
        with pytest.raises(TimeoutError):  # the queue is full: SYNs are dropped
            probe.connect((host, port))
        probe.close()
        yield
    finally:
        filler.close()
        listener.close()
