"""How an endpoint's secrets are encrypted at rest: their contexts, and re-keying them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.crypto import (
    SecretBox,
    key_parts,
    public_key_of,
    signature_scheme,
)
from outbox.errors import SecretKeyError
from outbox.sql import endpoints as queries


def secret_columns(box: SecretBox, uid: str, secret: str) -> dict[str, Any]:
    """The encrypted secret, its scheme and (ed25519) public key, as stored."""
    return {
        "signing_secret": box.encrypt(secret, context=secret_context(uid)),
        "signature_scheme": signature_scheme(secret),
        "public_key": public_key_of(secret),
    }


def secret_context(uid: str) -> str:
    """Associated data that ties an encrypted secret to its endpoint row."""
    return f"endpoint:{uid}"


def headers_context(uid: str) -> str:
    """Associated data of an endpoint's encrypted custom headers."""
    return f"endpoint:{uid}:headers"


def proxy_context(uid: str) -> str:
    """Associated data of an endpoint's encrypted proxy URL."""
    return f"endpoint:{uid}:proxy"


def client_certificate_context(uid: str) -> str:
    """Associated data of an endpoint's encrypted client certificate and key."""
    return f"endpoint:{uid}:client-certificate"


def oauth_context(uid: str) -> str:
    """Associated data of an endpoint's encrypted OAuth2 client credentials."""
    return f"endpoint:{uid}:oauth"


def decrypt_proxy(box: SecretBox, uid: str, stored: str) -> str:
    """The endpoint's proxy URL in plain text, for the HTTP client only."""
    return box.decrypt(stored, context=proxy_context(uid))


def check_keys_cover_stored_secrets(conn: Connection, box: SecretBox) -> None:
    """Refuse to start when a stored secret was encrypted with a key that is not configured."""
    missing: dict[str, int] = {}
    tried: set[str] = set()
    for row in conn.execute(queries.SELECT_STORED_SECRETS):
        for stored, context in (
            (row.signing_secret, secret_context(row.uid)),
            (row.previous_signing_secret, secret_context(row.uid)),
            (row.custom_headers, headers_context(row.uid)),
            (row.proxy_url, proxy_context(row.uid)),
            (row.client_certificate, client_certificate_context(row.uid)),
            (row.oauth_client, oauth_context(row.uid)),
        ):
            if not stored:
                continue
            kid = key_parts(stored)[1]
            if kid not in box.key_ids:
                missing[kid] = missing.get(kid, 0) + 1
            elif kid not in tried:
                # One trial decryption per key catches a key with the right id but
                # the wrong bytes (say, a lost and regenerated local key file).
                box.decrypt(stored, context=context)
                tried.add(kid)
    if missing:
        listed = ", ".join(f"{kid!r} ({count} secrets)" for kid, count in sorted(missing.items()))
        raise SecretKeyError(
            f"endpoint secrets are encrypted with key ids {listed} that OUTBOX_SECRET_KEYS does "
            "not hold: add those keys back (after the current one), then run `outbox keys rotate`"
        )


def reencrypt_secrets(conn: Connection, box: SecretBox, *, actor: str) -> int:
    """Re-encrypt every stored secret under the current key (`outbox keys rotate`)."""
    changed = 0
    for row in conn.execute(queries.SELECT_STORED_SECRETS).all():
        context = secret_context(row.uid)
        current = box.encrypt(box.decrypt(row.signing_secret, context=context), context=context)
        previous = (
            box.encrypt(box.decrypt(row.previous_signing_secret, context=context), context=context)
            if row.previous_signing_secret
            else None
        )
        extra = headers_context(row.uid)
        headers = (
            box.encrypt(box.decrypt(row.custom_headers, context=extra), context=extra)
            if row.custom_headers
            else None
        )
        via = proxy_context(row.uid)
        proxy = (
            box.encrypt(box.decrypt(row.proxy_url, context=via), context=via)
            if row.proxy_url
            else None
        )
        again = {
            name: box.encrypt(box.decrypt(stored, context=context), context=context)
            if stored
            else None
            for name, stored, context in (
                (
                    "client_certificate",
                    row.client_certificate,
                    client_certificate_context(row.uid),
                ),
                ("oauth_client", row.oauth_client, oauth_context(row.uid)),
            )
        }
        conn.execute(
            queries.SET_ENDPOINT_SECRETS,
            {
                "id": row.id,
                "signing_secret": current,
                "previous_signing_secret": previous,
                "custom_headers": headers,
                "proxy_url": proxy,
                **again,
            },
        )
        changed += 1
    record_audit(
        conn,
        actor=actor,
        action="keys.rotate",
        target_type="endpoint_secrets",
        target_id=None,
        details={"endpoints": changed, "key_id": box.current_key_id},
    )
    return changed
