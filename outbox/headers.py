"""Custom request headers per endpoint, such as an `Authorization` a partner asks for.

They are stored encrypted (they are usually credentials) and can never replace what
makes a webhook a webhook: the signature headers, the body's framing, the host and
the hop-by-hop headers are refused when set, and the sender adds its own last.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from sqlalchemy import Connection

from outbox.audit import record_audit
from outbox.crypto import SecretBox
from outbox.endpoints import get_endpoint, headers_context
from outbox.errors import EndpointError
from outbox.sql import endpoints as queries

# Names a custom header may not use, compared case-insensitively.
RESERVED_HEADERS = frozenset(
    {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "accept-encoding",
        "host",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "user-agent",
    }
)
MAX_HEADERS = 20
MAX_VALUE_LENGTH = 4096
_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")  # an RFC 9110 token


def validate_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Normalised {lower-case name: value}, or an EndpointError that names the problem."""
    if len(headers) > MAX_HEADERS:
        raise EndpointError(f"at most {MAX_HEADERS} custom headers per endpoint")
    clean: dict[str, str] = {}
    for name, value in headers.items():
        if not _NAME.match(name):
            raise EndpointError(f"{name!r} is not a valid header name (letters, digits, '-')")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS or lowered.startswith("webhook-"):
            raise EndpointError(
                f"{name!r} cannot be set per endpoint: the sender owns it (signature, body "
                "framing, host and hop-by-hop headers)"
            )
        if any(ch in value for ch in "\r\n\x00") or len(value) > MAX_VALUE_LENGTH:
            raise EndpointError(
                f"the value of {name!r} must be one line of at most {MAX_VALUE_LENGTH} characters"
            )
        clean[lowered] = value
    return clean


def parse_header_argument(text: str) -> tuple[str, str]:
    """'Authorization: Bearer x' -> ('Authorization', 'Bearer x'), as typed on a command line."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise EndpointError(f"{text!r} is not 'Name: value'")
    return name.strip(), value.strip()


def get_headers(
    conn: Connection, box: SecretBox, uid: str, *, scope: str | None = None
) -> dict[str, str]:
    get_endpoint(conn, uid, scope=scope)  # a clear error for an unknown (or unseen) id
    stored = conn.execute(queries.SELECT_ENDPOINT_HEADERS, {"uid": uid}).scalar_one()
    return decrypt_headers(box, uid, stored)


def decrypt_headers(box: SecretBox, uid: str, stored: str | None) -> dict[str, str]:
    if not stored:
        return {}
    loaded: dict[str, str] = json.loads(box.decrypt(stored, context=headers_context(uid)))
    return loaded


def set_headers(
    conn: Connection,
    box: SecretBox,
    uid: str,
    headers: Mapping[str, str],
    *,
    actor: str,
    reason: str | None = None,
    scope: str | None = None,
) -> list[str]:
    """Replace an endpoint's custom headers; audited with the names only, never the values."""
    clean = validate_headers(headers)
    get_endpoint(conn, uid, scope=scope)  # another tenant's endpoint: not found
    stored = box.encrypt(json.dumps(clean), context=headers_context(uid)) if clean else None
    updated = conn.execute(queries.SET_ENDPOINT_HEADERS, {"uid": uid, "custom_headers": stored})
    if updated.first() is None:
        raise EndpointError(f"no endpoint {uid!r}; `outbox endpoints list` shows the ids")
    record_audit(
        conn,
        actor=actor,
        action="endpoint.headers",
        target_type="endpoint",
        target_id=uid,
        reason=reason,
        details={"names": sorted(clean)},
    )
    return sorted(clean)
