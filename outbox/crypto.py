"""Endpoint secrets encrypted at rest with AES-256-GCM.

A stored value is `v1:<key id>:<base64(nonce || ciphertext)>`. The key id lets several
keys coexist: the first configured key encrypts, every configured key decrypts, so
keys rotate by adding a new first key and re-encrypting (`outbox keys rotate`).
The associated data binds a ciphertext to the row it belongs to, so a ciphertext
copied onto another endpoint does not decrypt.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from outbox.errors import ConfigurationError, SecretKeyError

_KEY_ID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_PREFIX = "v1"


class SecretBox:
    def __init__(self, keys: dict[str, bytes], current_key_id: str) -> None:
        if current_key_id not in keys:
            raise ConfigurationError(f"current key id {current_key_id!r} is not among the keys")
        self._keys = {kid: AESGCM(key) for kid, key in keys.items()}
        self.current_key_id = current_key_id

    @classmethod
    def from_setting(cls, value: str) -> SecretBox:
        """Parse OUTBOX_SECRET_KEYS: `kid:base64key[,kid:base64key...]`, first one encrypts."""
        keys: dict[str, bytes] = {}
        order: list[str] = []
        for item in (part.strip() for part in value.split(",")):
            if not item:
                continue
            kid, sep, encoded = item.partition(":")
            if not sep or not _KEY_ID.match(kid):
                raise ConfigurationError(
                    "OUTBOX_SECRET_KEYS entries look like 'k1:<base64 of 32 random bytes>'; "
                    "generate one with `outbox keys generate`"
                )
            try:
                raw = base64.b64decode(encoded, validate=True)
            except binascii.Error as exc:
                raise ConfigurationError(f"OUTBOX_SECRET_KEYS key {kid!r} is not base64") from exc
            if len(raw) != 32:
                raise ConfigurationError(
                    f"OUTBOX_SECRET_KEYS key {kid!r} must be 32 bytes, got {len(raw)}"
                )
            if kid in keys:
                raise ConfigurationError(f"OUTBOX_SECRET_KEYS names key id {kid!r} twice")
            keys[kid] = raw
            order.append(kid)
        if not order:
            raise ConfigurationError("OUTBOX_SECRET_KEYS is empty")
        return cls(keys, order[0])

    @property
    def key_ids(self) -> list[str]:
        return list(self._keys)

    def encrypt(self, plaintext: str, *, context: str) -> str:
        nonce = os.urandom(12)
        sealed = self._keys[self.current_key_id].encrypt(
            nonce, plaintext.encode(), context.encode()
        )
        token = base64.b64encode(nonce + sealed).decode()
        return f"{_PREFIX}:{self.current_key_id}:{token}"

    def decrypt(self, stored: str, *, context: str) -> str:
        prefix, kid, token = key_parts(stored)
        if prefix != _PREFIX:
            raise SecretKeyError(f"unknown secret format {prefix!r}")
        aead = self._keys.get(kid)
        if aead is None:
            raise SecretKeyError(
                f"a secret is encrypted with key id {kid!r}, which OUTBOX_SECRET_KEYS does not "
                "hold; add that key back (after the new one) until `outbox keys rotate` has run"
            )
        raw = base64.b64decode(token)
        try:
            return aead.decrypt(raw[:12], raw[12:], context.encode()).decode()
        except InvalidTag as exc:
            raise SecretKeyError(
                f"a secret did not decrypt with key {kid!r}: wrong key or tampered row"
            ) from exc


SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret


class InvalidSecretError(ValueError):
    """A signing secret is not `whsec_` followed by base64 of 24 to 64 bytes."""


def generate_secret() -> str:
    """A new Standard Webhooks signing secret."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()


def secret_key_bytes(secret: str) -> bytes:
    """The HMAC key inside a `whsec_` secret, or a clear error."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise InvalidSecretError(
            "a signing secret is 'whsec_' followed by base64, e.g. from `outbox endpoints add`"
        ) from exc
    if not 24 <= len(key) <= 64:
        raise InvalidSecretError(
            f"a signing secret is 'whsec_' followed by base64 of 24-64 bytes; this one "
            f"decodes to {len(key)} bytes"
        )
    return key


# Standard Webhooks asymmetric signatures (v1a): an ed25519 key pair. The secret key is
# `whsk_` + base64 of the 32-byte seed (a 64-byte seed||public key, as libsodium writes
# it, is accepted too); the public key the partner verifies with is `whpk_` + base64.
ED25519_SECRET_PREFIX = "whsk_"  # noqa: S105 - a format prefix, not a secret
ED25519_PUBLIC_PREFIX = "whpk_"
SIGNATURE_SCHEMES = ("hmac", "ed25519")

# What signs one delivery: an HMAC key (v1) or an ed25519 private key (v1a).
SigningKey = bytes | Ed25519PrivateKey


def generate_ed25519_secret() -> str:
    """A new `whsk_` secret key (its public key: `ed25519_public_key`)."""
    return ED25519_SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()


def ed25519_private_key(secret: str) -> Ed25519PrivateKey:
    """The private key inside a `whsk_` secret key, or a clear error."""
    try:
        raw = base64.b64decode(secret.removeprefix(ED25519_SECRET_PREFIX), validate=True)
    except binascii.Error as exc:
        raise InvalidSecretError(
            "an ed25519 secret key is 'whsk_' followed by base64 of the 32-byte seed"
        ) from exc
    if len(raw) not in (32, 64):
        raise InvalidSecretError(
            f"an ed25519 secret key is 'whsk_' followed by base64 of 32 bytes (or 64: seed "
            f"and public key); this one decodes to {len(raw)} bytes"
        )
    key = Ed25519PrivateKey.from_private_bytes(raw[:32])
    if len(raw) == 64 and raw[32:] != _public_bytes(key):
        raise InvalidSecretError("this 64-byte ed25519 key's second half is not its public key")
    return key


def _public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def ed25519_public_key(secret: str) -> str:
    """The `whpk_` public key a partner verifies `v1a` signatures with."""
    public = _public_bytes(ed25519_private_key(secret))
    return ED25519_PUBLIC_PREFIX + base64.b64encode(public).decode()


def signature_scheme(secret: str) -> str:
    """'ed25519' for a `whsk_` secret key, 'hmac' for anything else (checked on use)."""
    return "ed25519" if secret.startswith(ED25519_SECRET_PREFIX) else "hmac"


def signing_key(secret: str) -> SigningKey:
    """The key a stored secret signs with, whichever scheme it is; InvalidSecretError if junk."""
    if secret.startswith(ED25519_SECRET_PREFIX):
        return ed25519_private_key(secret)
    return secret_key_bytes(secret)


def generate_signing_secret(scheme: str) -> str:
    if scheme not in SIGNATURE_SCHEMES:
        raise InvalidSecretError(f"signature scheme {scheme!r} is not one of hmac, ed25519")
    return generate_ed25519_secret() if scheme == "ed25519" else generate_secret()


def public_key_of(secret: str) -> str | None:
    """The public key to show for a secret: `whpk_...` for ed25519, None for HMAC."""
    return ed25519_public_key(secret) if signature_scheme(secret) == "ed25519" else None


def key_parts(stored: str) -> tuple[str, str, str]:
    parts = stored.split(":", 2)
    if len(parts) != 3:
        raise SecretKeyError("stored secret is not in 'v1:<kid>:<data>' form")
    return parts[0], parts[1], parts[2]


def generate_key(key_id: str | None = None) -> str:
    """A new OUTBOX_SECRET_KEYS entry."""
    kid = key_id or "k" + secrets.token_hex(4)
    return f"{kid}:{base64.b64encode(os.urandom(32)).decode()}"


def load_or_create_local_key(data_dir: Path) -> str:
    """Zero-config key for the embedded demo: created once in the data dir, mode 0600."""
    path = data_dir / "secret.key"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    value = generate_key("local")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value
