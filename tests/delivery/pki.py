"""A test PKI for mutual TLS: certificate authorities that issue server and client
certificates, and a server TLS context on 127.0.0.1 that requires a client certificate
(tests/delivery/test_authenticated_delivery.py, test_proxy.py)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from outbox.endpoint_auth import ClientCertificate, check_client_certificate

NOW = dt.datetime.now(dt.UTC)


@dataclass
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    cert: x509.Certificate | None = None

    def __post_init__(self) -> None:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - dt.timedelta(minutes=5))
            .not_valid_after(NOW + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> str:
        assert self.cert is not None
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(
        self, name: str, *, server: bool = False, expires: dt.datetime | None = None
    ) -> tuple[str, str]:
        """(certificate PEM, key PEM) for `name` (a client, or the server 127.0.0.1)."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - dt.timedelta(days=2))
            .not_valid_after(expires or NOW + dt.timedelta(hours=6))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def identity(authority: Authority, name: str) -> ClientCertificate:
    cert, key = authority.issue(name)
    checked, _ = check_client_certificate(cert, key, now=NOW)
    return checked


def mtls_server_context(
    tmp_path: Path, server_ca: Authority, client_ca: Authority
) -> ssl.SSLContext:
    """A server context for 127.0.0.1 that REQUIRES a client certificate from `client_ca`."""
    cert, key = server_ca.issue("127.0.0.1", server=True)
    (tmp_path / "server.pem").write_text(key + cert)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "server.pem")
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=client_ca.pem)
    return context


def trusting(authority: Authority) -> Callable[[], ssl.SSLContext]:
    return lambda: ssl.create_default_context(cadata=authority.pem)
