"""Standard Webhooks signatures (https://www.standardwebhooks.com).

The signed content is `{msg_id}.{timestamp}.{body}`, HMAC-SHA256 keyed with the
base64-decoded part of the secret after `whsec_`. The header carries one
`v1,<base64>` per active secret, separated by spaces, so receivers keep verifying
while a secret rotates.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

SECRET_PREFIX = "whsec_"


class InvalidSecretError(ValueError):
    """A signing secret is not `whsec_` followed by base64 of 24 to 64 bytes."""


def generate_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()


def secret_key_bytes(secret: str) -> bytes:
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise InvalidSecretError(
            "a signing secret is 'whsec_' followed by base64, e.g. from `outbox endpoints add`"
        ) from exc
    if not 24 <= len(key) <= 64:
        raise InvalidSecretError(f"a signing secret must decode to 24-64 bytes, got {len(key)}")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` signature over exactly the bytes that are sent."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signature_header(keys: list[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    return " ".join(sign(key, msg_id, timestamp, body) for key in keys)
