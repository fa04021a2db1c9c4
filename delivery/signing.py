"""Standard Webhooks signatures (https://www.standardwebhooks.com).

The signed content is `{msg_id}.{timestamp}.{body}`. Two schemes:

- `v1`: HMAC-SHA256 keyed with the base64-decoded part of the secret after `whsec_`;
- `v1a`: ed25519 with the private key of a `whsk_` secret key; partners verify with
  the `whpk_` public key and never hold anything secret.

The header carries one signature per active secret, separated by spaces, so receivers
keep verifying while a secret rotates (even from one scheme to the other).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from outbox.crypto import (
    SECRET_PREFIX,
    InvalidSecretError,
    SigningKey,
    generate_secret,
    secret_key_bytes,
    signing_key,
)

__all__ = [
    "SECRET_PREFIX",
    "InvalidSecretError",
    "SigningKey",
    "generate_secret",
    "secret_key_bytes",
    "sign",
    "signature_header",
    "signing_key",
]


def sign(key: SigningKey, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` (HMAC) or `v1a,<base64>` (ed25519) signature over exactly the
    bytes that are sent."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    if isinstance(key, Ed25519PrivateKey):
        return "v1a," + base64.b64encode(key.sign(content)).decode()
    mac = hmac.new(key, content, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signature_header(keys: list[SigningKey], msg_id: str, timestamp: int, body: bytes) -> str:
    if len(keys) == 1:  # the usual case, no secret rotating: no generator and join per attempt
        return sign(keys[0], msg_id, timestamp, body)
    return " ".join([sign(key, msg_id, timestamp, body) for key in keys])
