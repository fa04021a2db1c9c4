"""Standard Webhooks signatures (https://www.standardwebhooks.com).

The signed content is `{msg_id}.{timestamp}.{body}`, HMAC-SHA256 keyed with the
base64-decoded part of the secret after `whsec_`. The header carries one
`v1,<base64>` per active secret, separated by spaces, so receivers keep verifying
while a secret rotates.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from outbox.crypto import (
    SECRET_PREFIX,
    InvalidSecretError,
    generate_secret,
    secret_key_bytes,
)

__all__ = [
    "SECRET_PREFIX",
    "InvalidSecretError",
    "generate_secret",
    "secret_key_bytes",
    "sign",
    "signature_header",
]


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` signature over exactly the bytes that are sent."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signature_header(keys: list[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    return " ".join(sign(key, msg_id, timestamp, body) for key in keys)
