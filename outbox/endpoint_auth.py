"""Authenticated delivery per endpoint: a client certificate for mutual TLS, and OAuth2
client credentials whose bearer token the worker fetches (delivery/oauth.py).

Why here: both are secrets an operator sets on an endpoint, so they are validated when
set (a bad certificate is refused now, not at 3 a.m. on the first delivery), stored
encrypted like the signing secrets, audited, and shown only as a summary (subject,
fingerprint and expiry; token URL, client id and scope), never returned or logged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.crypto import SecretBox
from outbox.endpoints import client_certificate_context, endpoint_not_found, oauth_context
from outbox.errors import EndpointError
from outbox.sql import endpoints as queries
from outbox.tenants import scope_params
from outbox.urls import validate_endpoint_url

# A client certificate chain or key larger than this is refused: real ones are a few KiB.
MAX_PEM_BYTES = 64 * 1024
MAX_OAUTH_FIELD = 2048


@dataclass(frozen=True, slots=True)
class ClientCertificate:
    """A validated certificate chain and key, PEM. `version` names this pair (a digest):
    the wire caches its TLS context and pools its connections under it."""

    certificate_pem: str = field(repr=False)
    key_pem: str = field(repr=False)
    not_after: dt.datetime | None = None  # the leaf's expiry: past it, nothing is sent

    @property
    def version(self) -> str:
        joined = (self.certificate_pem + "\0" + self.key_pem).encode()
        return hashlib.sha256(joined).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class OAuthClient:
    """OAuth2 client credentials (RFC 6749 section 4.4); the secret never in a repr."""

    token_url: str
    client_id: str
    client_secret: str = field(repr=False)
    scope: str | None = None

    @property
    def cache_key(self) -> str:
        """Names these credentials for the token cache (a digest, not the secret)."""
        joined = "\0".join((self.token_url, self.client_id, self.client_secret, self.scope or ""))
        return hashlib.sha256(joined.encode()).hexdigest()


def _pem_text(value: str | bytes, what: str) -> str:
    if isinstance(value, bytes):
        if len(value) > MAX_PEM_BYTES:
            raise EndpointError(f"the {what} is {len(value)} bytes; the limit is {MAX_PEM_BYTES}")
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError as exc:
            raise EndpointError(
                f"the {what} is not PEM text (it has non-ASCII bytes; a DER file? convert it "
                "with `openssl x509 -inform der -out cert.pem`)"
            ) from exc
    if len(value) > MAX_PEM_BYTES:
        raise EndpointError(f"the {what} is {len(value)} bytes; the limit is {MAX_PEM_BYTES}")
    if "-----BEGIN " not in value:
        raise EndpointError(f"the {what} is not PEM: it has no '-----BEGIN ...-----' line")
    return value


def check_client_certificate(
    certificate: str | bytes, key: str | bytes, *, now: dt.datetime
) -> tuple[ClientCertificate, dict[str, Any]]:
    """Parse and check a client certificate (chain, leaf first) and its private key: the
    key must match the leaf, the leaf must be valid `now`. Returns the pair and its
    summary for display. EndpointError says what is wrong."""
    cert_pem = _pem_text(certificate, "client certificate")
    key_pem = _pem_text(key, "client key")
    try:
        chain = x509.load_pem_x509_certificates(cert_pem.encode())
    except ValueError as exc:
        raise EndpointError(
            f"the client certificate is not a PEM X.509 certificate ({exc}); give the "
            "certificate file (BEGIN CERTIFICATE), leaf first"
        ) from exc
    try:
        private = serialization.load_pem_private_key(key_pem.encode(), password=None)
    except (ValueError, TypeError) as exc:
        raise EndpointError(
            "the client key is not an unencrypted PEM private key (BEGIN PRIVATE KEY); "
            "decrypt it first (`openssl pkey -in key.pem -out plain.pem`)"
        ) from exc
    if not isinstance(
        private,
        (
            rsa.RSAPrivateKey,
            ec.EllipticCurvePrivateKey,
            ed25519.Ed25519PrivateKey,
            ed448.Ed448PrivateKey,
            dsa.DSAPrivateKey,
        ),
    ):
        raise EndpointError("the client key is of a type TLS client certificates cannot use")
    leaf = chain[0]
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(
        serialization.Encoding.DER, public
    ) != private.public_key().public_bytes(serialization.Encoding.DER, public):
        raise EndpointError(
            "the client key does not match the client certificate (the first certificate "
            "in the file must be the one issued for this key)"
        )
    if leaf.not_valid_after_utc <= now:
        raise EndpointError(
            f"the client certificate expired at {leaf.not_valid_after_utc.isoformat()}; "
            "give a current one"
        )
    if leaf.not_valid_before_utc > now:
        raise EndpointError(
            f"the client certificate is not valid before "
            f"{leaf.not_valid_before_utc.isoformat()}; give one valid now"
        )
    summary = {
        "subject": leaf.subject.rfc4514_string(),
        "issuer": leaf.issuer.rfc4514_string(),
        "fingerprint_sha256": leaf.fingerprint(hashes.SHA256()).hex(),
        "not_after": leaf.not_valid_after_utc.isoformat(),
    }
    return ClientCertificate(cert_pem, key_pem, leaf.not_valid_after_utc), summary


def check_oauth_client(
    token_url: str,
    client_id: str,
    client_secret: str,
    scope: str | None,
    *,
    https_only: bool = False,
) -> tuple[OAuthClient, dict[str, Any]]:
    """Check OAuth2 client credentials; returns them and their summary (no secret)."""
    try:
        url = validate_endpoint_url(token_url, https_only=https_only)
    except EndpointError as exc:
        raise EndpointError(f"the OAuth token URL: {exc}") from exc
    for name, value in (("client id", client_id), ("client secret", client_secret)):
        if not value or not value.strip():
            raise EndpointError(f"the OAuth {name} is empty; give one")
        if len(value) > MAX_OAUTH_FIELD or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise EndpointError(
                f"the OAuth {name} must be at most {MAX_OAUTH_FIELD} characters without "
                "control characters"
            )
    if scope is not None and (
        len(scope) > MAX_OAUTH_FIELD or any(ord(c) < 0x20 or ord(c) == 0x7F for c in scope)
    ):
        raise EndpointError(
            f"the OAuth scope must be at most {MAX_OAUTH_FIELD} characters without control "
            "characters"
        )
    client = OAuthClient(url, client_id, client_secret, scope or None)
    return client, {"token_url": url, "client_id": client_id, "scope": client.scope}


@dataclass(frozen=True, slots=True)
class EndpointAuth:
    """What an endpoint's authenticated delivery is, as operators see it (no secrets)."""

    uid: str
    client_certificate: dict[str, Any] | None
    oauth: dict[str, Any] | None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.uid,
            "client_certificate": self.client_certificate,
            "oauth": self.oauth,
        }


def get_endpoint_auth(conn: Connection, uid: str, *, scope: str | None = None) -> EndpointAuth:
    row = conn.execute(
        queries.SELECT_ENDPOINT_CLIENT_AUTH, {"uid": uid, **scope_params(conn, scope)}
    ).first()
    if row is None:
        raise endpoint_not_found(uid)
    return EndpointAuth(
        uid,
        json.loads(row.client_certificate_info) if row.client_certificate_info else None,
        json.loads(row.oauth_client_info) if row.oauth_client_info else None,
    )


_KEEP: Any = object()


def set_endpoint_auth(
    conn: Connection,
    box: SecretBox,
    uid: str,
    *,
    client_certificate: ClientCertificate | None = _KEEP,
    certificate_summary: dict[str, Any] | None = None,
    oauth: OAuthClient | None = _KEEP,
    oauth_summary: dict[str, Any] | None = None,
    actor: str,
    reason: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
) -> EndpointAuth:
    """Set (or with None, clear) an endpoint's client certificate and/or OAuth2 client;
    an argument left out keeps what is stored. Checked values come from
    `check_client_certificate` / `check_oauth_client`. The audit row holds the
    summaries only."""
    row = conn.execute(
        queries.SELECT_ENDPOINT_CLIENT_AUTH, {"uid": uid, **scope_params(conn, scope)}
    ).first()
    if row is None:
        raise endpoint_not_found(uid)
    values = {
        "client_certificate": row.client_certificate,
        "client_certificate_info": row.client_certificate_info,
        "oauth_client": row.oauth_client,
        "oauth_client_info": row.oauth_client_info,
    }
    if client_certificate not in (None, _KEEP) and not row.url.startswith("https://"):
        raise EndpointError(
            "a client certificate is presented over HTTPS only, and this endpoint's URL is "
            f"{row.url.split(':', 1)[0]}://...; change the URL to https:// first"
        )
    changed: dict[str, Any] = {}
    if client_certificate is not _KEEP:
        if client_certificate is None:
            values["client_certificate"] = values["client_certificate_info"] = None
        else:
            values["client_certificate"] = box.encrypt(
                json.dumps(
                    {
                        "certificate": client_certificate.certificate_pem,
                        "key": client_certificate.key_pem,
                    }
                ),
                context=client_certificate_context(uid),
            )
            values["client_certificate_info"] = json.dumps(certificate_summary)
        changed["client_certificate"] = certificate_summary if client_certificate else None
    if oauth is not _KEEP:
        if oauth is None:
            values["oauth_client"] = values["oauth_client_info"] = None
        else:
            values["oauth_client"] = box.encrypt(
                json.dumps(
                    {
                        "token_url": oauth.token_url,
                        "client_id": oauth.client_id,
                        "client_secret": oauth.client_secret,
                        "scope": oauth.scope,
                    }
                ),
                context=oauth_context(uid),
            )
            values["oauth_client_info"] = json.dumps(oauth_summary)
        changed["oauth"] = oauth_summary if oauth else None
    conn.execute(
        queries.SET_ENDPOINT_CLIENT_AUTH, {"uid": uid, **values, **scope_params(conn, scope)}
    )
    record_audit(
        conn,
        actor=actor,
        action="endpoint.auth",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        request_id=request_id,
        details=changed,
    )
    return get_endpoint_auth(conn, uid, scope=scope)


def decrypt_client_certificate(box: SecretBox, uid: str, stored: str) -> ClientCertificate:
    """The endpoint's certificate and key, for the wire only."""
    data = json.loads(box.decrypt(stored, context=client_certificate_context(uid)))
    leaf = x509.load_pem_x509_certificates(data["certificate"].encode())[0]
    return ClientCertificate(data["certificate"], data["key"], leaf.not_valid_after_utc)


def decrypt_oauth_client(box: SecretBox, uid: str, stored: str) -> OAuthClient:
    """The endpoint's OAuth2 client credentials, for the token fetch only."""
    data = json.loads(box.decrypt(stored, context=oauth_context(uid)))
    return OAuthClient(data["token_url"], data["client_id"], data["client_secret"], data["scope"])
