"""Verify a webhook you received: the receiver's half of Standard Webhooks signing.

Partners can use any Standard Webhooks library; this helper exists so Python
receivers (and our own tests and examples) need nothing else, and so the rules a
receiver should apply are written down in one place:

- the three `webhook-*` headers are required, whatever their case;
- the timestamp must be within `tolerance` of now in BOTH directions, which is
  what makes a captured request useless for a replay later;
- any one signature of the key's scheme may match (the sender lists one per active
  secret while a secret rotates): `v1` (HMAC-SHA256) for a `whsec_` secret, `v1a`
  (ed25519) for a `whpk_` public key; other versions are skipped so new schemes can
  be added;
- HMACs are compared in constant time, ed25519 signatures checked by `cryptography`,
  and only then is the body parsed.

The HMAC itself comes from `delivery.signing`, so sender and receiver cannot drift.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from delivery.errors import (
    InvalidPayloadError,
    MissingHeaderError,
    SignatureMismatchError,
    TimestampError,
    WebhookVerificationError,
)
from delivery.signing import InvalidSecretError, secret_key_bytes, sign
from outbox.crypto import ED25519_PUBLIC_PREFIX, ED25519_SECRET_PREFIX, ed25519_public_key

__all__ = [
    "DEFAULT_TOLERANCE",
    "InvalidPayloadError",
    "MissingHeaderError",
    "SignatureMismatchError",
    "TimestampError",
    "WebhookVerificationError",
    "verify",
]

DEFAULT_TOLERANCE = dt.timedelta(minutes=5)
_UNIX_SECONDS = re.compile(r"^[0-9]{1,12}$")


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes | str,
    *,
    tolerance: dt.timedelta = DEFAULT_TOLERANCE,
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """Check a received webhook and return its JSON event; raise if it is not authentic.

    `secret` is the endpoint's `whsec_...` secret or, for an ed25519 endpoint, its
    `whpk_...` public key; `headers` the request headers
    (any mapping, any case), `body` the raw request body exactly as received:
    re-serialised JSON does not verify. `now` defaults to the system clock; pass
    it to test. Every failure is a `WebhookVerificationError` (answer 400 and do
    not process the event); a malformed `secret` raises `InvalidSecretError`,
    because that is the receiver's configuration, not the request, at fault.
    """
    if tolerance < dt.timedelta(0):
        raise ValueError("tolerance must not be negative")
    if now is None:
        now = dt.datetime.now(dt.UTC)
    elif now.tzinfo is None:
        raise ValueError("now must be timezone-aware, e.g. datetime.now(timezone.utc)")
    if secret.startswith(ED25519_SECRET_PREFIX):
        secret = ed25519_public_key(secret)  # whoever holds the secret key holds this too
    public = _ed25519_public(secret) if secret.startswith(ED25519_PUBLIC_PREFIX) else None
    key = secret_key_bytes(secret) if public is None else b""

    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id = _required(lowered, "webhook-id")
    timestamp = _timestamp(_required(lowered, "webhook-timestamp"), now, tolerance)
    offered = _required(lowered, "webhook-signature")

    payload = body.encode() if isinstance(body, str) else bytes(body)
    if public is not None:
        content = f"{msg_id}.{timestamp}.".encode() + payload
        if not _any_ed25519_signature_matches(offered, public, content):
            raise SignatureMismatchError(
                "no v1a signature in webhook-signature verifies with this public key; check "
                "that it is this endpoint's current whpk_ key and that the body is verified "
                "exactly as received"
            )
        return _parse(payload)
    expected = base64.b64decode(sign(key, msg_id, timestamp, payload).removeprefix("v1,"))
    if not _any_signature_matches(offered, expected):
        raise SignatureMismatchError(
            "no v1 signature in webhook-signature matches this body; check that the secret "
            "is this endpoint's current one and that the body is verified exactly as received"
        )
    return _parse(payload)


def _ed25519_public(value: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(value.removeprefix(ED25519_PUBLIC_PREFIX), validate=True)
    except binascii.Error as exc:
        raise InvalidSecretError("a public key is 'whpk_' followed by base64 of 32 bytes") from exc
    if len(raw) != 32:
        raise InvalidSecretError(
            f"a public key is 'whpk_' followed by base64 of 32 bytes; this one has {len(raw)}"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def _any_ed25519_signature_matches(offered: str, public: Ed25519PublicKey, content: bytes) -> bool:
    for candidate in offered.split():
        version, sep, encoded = candidate.partition(",")
        if version != "v1a" or not sep:
            continue
        try:
            public.verify(base64.b64decode(encoded, validate=True), content)
        except (binascii.Error, ValueError, InvalidSignature):
            continue
        return True
    return False


def _required(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name, "").strip()
    if not value:
        raise MissingHeaderError(f"the {name} header is missing or empty; reject the request")
    return value


def _timestamp(value: str, now: dt.datetime, tolerance: dt.timedelta) -> int:
    if not _UNIX_SECONDS.match(value):
        raise TimestampError(f"webhook-timestamp {value[:32]!r} is not whole unix seconds")
    timestamp = int(value)
    sent = dt.datetime.fromtimestamp(timestamp, dt.UTC)
    if sent < now - tolerance:
        raise TimestampError(
            f"webhook-timestamp is {(now - sent).total_seconds():.0f}s old, beyond the "
            f"{tolerance.total_seconds():.0f}s tolerance: a replay, or this host's clock is "
            "wrong (check NTP)"
        )
    if sent > now + tolerance:
        raise TimestampError(
            f"webhook-timestamp is {(sent - now).total_seconds():.0f}s in the future, beyond "
            f"the {tolerance.total_seconds():.0f}s tolerance: a clock is wrong (check NTP)"
        )
    return timestamp


def _digest(signature: str) -> bytes | None:
    """The raw MAC of one `v1,<base64>` signature, or None if it is not well-formed."""
    version, sep, encoded = signature.partition(",")
    if version != "v1" or not sep:
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None


def _any_signature_matches(offered: str, expected: bytes) -> bool:
    matched = False
    for candidate in offered.split():
        digest = _digest(candidate)
        # Unknown versions and malformed entries are skipped, not errors: a sender may
        # add schemes this receiver does not know yet.
        if digest is not None and hmac.compare_digest(digest, expected):
            matched = True
    return matched


def _parse(payload: bytes) -> dict[str, Any]:
    try:
        event = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayloadError(
            f"the body is correctly signed but is not UTF-8 JSON ({exc}); report it to the sender"
        ) from exc
    if not isinstance(event, dict):
        raise InvalidPayloadError(
            f"the body is correctly signed but is a JSON {type(event).__name__}, not an object"
        )
    return event
