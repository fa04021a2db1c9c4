"""Small helpers the integration tests share."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox.crypto import SecretBox
from outbox.endpoints import CreatedEndpoint, create_endpoint, set_enabled

# The repository's root, for tests that read its files (README, docs, config, tools).
ROOT = Path(__file__).resolve().parent.parent

# The SSRF guard refuses loopback unless allowed; test receivers live there.
LOOPBACK = ("127.0.0.0/8",)

# For a worker test whose verdict is made after the response (leases, the reaper, retry
# policy, signing): it runs on the production wire only, not on both transports of the
# `transport` fixture (the status, connection and deadline rules still run on both).
WIRE_ONLY = pytest.mark.parametrize("transport", ["wire"])


def add_endpoint(
    engine: Engine, box: SecretBox, url: str, events: str = "*", **kwargs: Any
) -> CreatedEndpoint:
    """An endpoint with fixed concurrency (no in-flight limit) unless `concurrency` says
    otherwise: most tests are about something else than the adaptive limiter, which starts
    new endpoints at 4 in flight (the default for new endpoints: tests/outbox/
    test_adaptive_default.py)."""
    kwargs.setdefault("concurrency", "fixed")
    with engine.begin() as conn:
        return create_endpoint(conn, box, url=url, event_types=events, **kwargs)


def disable(engine: Engine, uid: str) -> None:
    with engine.begin() as conn:
        set_enabled(conn, uid, enabled=False, reason="test", actor="test")


def rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).mappings())


def scalar(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


async def until(
    condition: Callable[[], object], what: str = "the condition", seconds: float = 20.0
) -> None:
    """Wait until `condition()` holds, looking every 10 ms; fail naming `what` after `seconds`.

    Tests wait on the event itself, never for a fixed time: the deadline only bounds a
    hang, so a slow or loaded machine makes a test slower, not wrong.
    """
    try:
        async with asyncio.timeout(seconds):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"waited {seconds:g} s for {what}")


def self_signed_client_certificate(
    common_name: str, *, valid_for: dt.timedelta = dt.timedelta(days=30)
) -> tuple[str, str]:
    """(certificate PEM, key PEM) of a self-signed client certificate valid from a day
    ago, for tests that set an endpoint's mutual TLS without a receiver checking it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + valid_for)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem
