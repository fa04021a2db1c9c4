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
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
