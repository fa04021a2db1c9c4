"""What the console's and portal's endpoint page reads of authenticated delivery
(delivery.operator.console.scoped.endpoint_auth_view): the certificate's expiry as the
page flags it, the token's last use and error from the attempts, within the tenant."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import Engine, text

from delivery.operator.console.scoped import endpoint_auth_view
from outbox.crypto import SecretBox
from outbox.endpoint_auth import check_client_certificate, check_oauth_client, set_endpoint_auth
from outbox.errors import NotFoundError
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, self_signed_client_certificate

NOW = dt.datetime.now(dt.UTC)


def test_expiry_token_activity_and_tenant_scope(engine: Engine, box: SecretBox) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "seller-a")
        create_tenant(conn, "seller-b")
    uid = add_endpoint(engine, box, "https://a.example/h", tenant="seller-a").endpoint.uid
    bare = add_endpoint(engine, box, "https://b.example/h", tenant="seller-b").endpoint.uid
    checked, summary = check_client_certificate(
        *self_signed_client_certificate("a", valid_for=dt.timedelta(days=10)), now=NOW
    )
    client, shown = check_oauth_client("https://auth.a.example/t", "app", "s3cret", None)
    with engine.begin() as conn:
        set_endpoint_auth(
            conn, box, uid, client_certificate=checked, certificate_summary=summary,
            oauth=client, oauth_summary=shown, actor="t",
        )  # fmt: skip
        # Two attempts of one delivery: one sent with a token, then one that got none.
        conn.execute(
            text(
                "INSERT INTO outbox_events (message_id, event_type, payload, tenant_id) "
                "SELECT 'msg_1', 'x', '{}', id FROM tenants WHERE uid = 'seller-a'"
            )
        )
        conn.execute(
            text(
                "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts, "
                "next_attempt_at) SELECT (SELECT id FROM outbox_events), id, tenant_id, 5, :now "
                "FROM endpoints WHERE uid = :u"
            ),
            {"now": NOW, "u": uid},
        )
        for number, at, error, headers in (
            (1, NOW - dt.timedelta(hours=2), None, '{"authorization": "[redacted]"}'),
            (2, NOW - dt.timedelta(hours=1), "no OAuth access token: it answered HTTP 500", "{}"),
        ):
            conn.execute(
                text(
                    "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at, "
                    "duration_ms, status_code, outcome, error, request_headers, worker_id) "
                    "SELECT id, :n, :at, 5, :status, 'retryable', :error, CAST(:h AS jsonb), 'w' "
                    "FROM deliveries"
                ),
                {"n": number, "at": at, "status": 503 if error is None else None,
                 "error": error, "h": headers},
            )  # fmt: skip
    with engine.connect() as conn:
        now = endpoint_auth_view(conn, uid, "seller-a", now=NOW)
        later = endpoint_auth_view(conn, uid, None, now=NOW + dt.timedelta(days=11))
        with pytest.raises(NotFoundError):
            endpoint_auth_view(conn, uid, "seller-b", now=NOW)
        assert endpoint_auth_view(conn, bare, "seller-b", now=NOW) == {
            "client_certificate": None,
            "oauth": None,
        }
    certificate = now["client_certificate"]
    assert (certificate["expired"], certificate["days_left"]) == (False, 10)
    assert certificate["subject"] == "CN=a" and "key" not in str(certificate).lower()
    assert later["client_certificate"]["expired"] is True
    assert now["oauth"] == {
        "token_url": "https://auth.a.example/t",
        "client_id": "app",
        "scope": None,
        "token_used_at": NOW - dt.timedelta(hours=2),
        "token_error_at": NOW - dt.timedelta(hours=1),
        "token_error": "it answered HTTP 500",
    }
    # Older than the page's day: not shown (the query stays on the recent attempts).
    assert later["oauth"]["token_used_at"] is None and later["oauth"]["token_error"] is None
