"""Endpoint operations and the audit log: exact refusals, bounds, audit rows and filters.

Each operator action on an endpoint writes one audit row; the tests pin every field of
it (who, what, which row, why, the request id, the details a reviewer reads), every
bound an operator can hit, and that a tenant scope cannot reach another tenant's row.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import audit as audit_ops
from outbox import endpoints as endpoint_ops
from outbox.audit import record_audit, record_audit_many
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_secret
from outbox.endpoints import get_endpoint, secret_context
from outbox.errors import EndpointError, EndpointNotFoundError, OperationError
from outbox.tenants import create_tenant
from tests.helpers import add_endpoint, rows, scalar
from tests.outbox.deliveries_helpers import audit_rows, deliveries_in, refused

URL = "https://partner.example/hooks"


def _stored_secret(engine: Engine, box: SecretBox, uid: str, column: str) -> str:
    stored = scalar(engine, f"SELECT {column} FROM endpoints WHERE uid = :uid", uid=uid)
    return box.decrypt(stored, context=secret_context(uid))


def test_add_endpoint_passes_every_setting_on_and_audits_it(engine: Engine, box: SecretBox) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        plain = endpoint_ops.add_endpoint(
            conn,
            box,
            actor="ann",
            url="http://hooks.example/a",  # http is allowed unless https_only
            event_types="order.*",
            request_id="req-1",
        )
        secret = generate_secret()
        given = endpoint_ops.add_endpoint(
            conn,
            box,
            actor="ann",
            url="https://acme.example/b",
            event_types=["invoice.paid", "order.*"],
            secret=secret,
            description="billing",
            tenant="acme",
        )
        everyone = endpoint_ops.add_endpoint(
            conn,
            box,
            actor="ann",
            url="https://all.example/c",
            event_types="*",
            signature="ed25519",
            all_tenants=True,
        )
        with refused(
            EndpointError,
            "the endpoint URL must start with https:// (this deployment only sends over https)",
        ):
            endpoint_ops.add_endpoint(
                conn, box, actor="ann", url="http://x.example/", event_types="*", https_only=True
            )
    first = plain.endpoint
    assert (first.url, first.event_types, first.description) == (
        "http://hooks.example/a",
        ["order.*"],
        "",
    )
    assert (first.tenant, first.all_tenants, first.signature_scheme) == ("default", False, "hmac")
    assert plain.secret.startswith("whsec_")
    assert _stored_secret(engine, box, first.uid, "signing_secret") == plain.secret
    second = given.endpoint
    assert (second.tenant, second.description, second.event_types) == (
        "acme",
        "billing",
        ["invoice.paid", "order.*"],
    )
    assert given.secret == secret
    assert _stored_secret(engine, box, second.uid, "signing_secret") == secret
    third = everyone.endpoint
    assert (third.all_tenants, third.signature_scheme) == (True, "ed25519")
    assert everyone.secret.startswith("whsk_")

    assert audit_rows(engine, "endpoint.create") == [
        {
            "actor": "ann",
            "action": "endpoint.create",
            "target_type": "endpoint",
            "target_id": created.endpoint.uid,
            "reason": None,
            "details": {
                "url": created.endpoint.url,
                "event_types": created.endpoint.event_types,
                "all_tenants": created.endpoint.all_tenants,
                # issue 25: how it receives its events and what it filters on
                "delivery_mode": "push",
                "payload_filter": None,
                # adaptive unless told fixed (the default for new endpoints)
                "concurrency": "adaptive",
            },
            "request_id": request_id,
            "tenant_uid": created.endpoint.tenant,
        }
        for created, request_id in ((plain, "req-1"), (given, None), (everyone, None))
    ]


def test_update_endpoint_bounds_messages_and_audit(engine: Engine, box: SecretBox) -> None:
    uid = add_endpoint(engine, box, URL, "order.*", description="old").endpoint.uid
    with engine.begin() as conn:
        for timeout in (0, -1):
            with refused(EndpointError, "the timeout must be a positive number of seconds"):
                endpoint_ops.update_endpoint(conn, uid, actor="d", timeout_seconds=timeout)
        for attempts in (0, 101):
            with refused(EndpointError, "max attempts must be between 1 and 100"):
                endpoint_ops.update_endpoint(conn, uid, actor="d", max_attempts=attempts)
        with refused(EndpointError, "nothing to change: give --url, --events, --description, ..."):
            endpoint_ops.update_endpoint(conn, uid, actor="d")
        with refused(
            EndpointError,
            "the endpoint URL must start with https:// (this deployment only sends over https)",
        ):
            endpoint_ops.update_endpoint(
                conn, uid, actor="d", url="http://x.example/", https_only=True
            )
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0

    def settings() -> tuple[Any, ...]:
        found = rows(
            engine,
            "SELECT url, description, event_types, timeout_seconds, max_attempts"
            " FROM endpoints WHERE uid = :uid",
            uid=uid,
        )
        return tuple(found[0].values())

    def update(**kwargs: Any) -> Any:
        with engine.begin() as conn:
            return endpoint_ops.update_endpoint(conn, uid, **kwargs)

    update(actor="d", timeout_seconds=0.5, max_attempts=1)
    assert settings() == (URL, "old", ["order.*"], 0.5, 1)
    update(actor="d", max_attempts=100)
    assert settings() == (URL, "old", ["order.*"], 0.5, 100)
    # Only what is given changes: the timeout and max attempts stay.
    updated = update(actor="erin", description="new", reason="renamed", request_id="req-2")
    assert settings() == (URL, "new", ["order.*"], 0.5, 100)
    with engine.connect() as conn:
        assert updated == get_endpoint(conn, uid)
    update(actor="d", url="http://moved.example/h", event_types="*")
    assert settings() == ("http://moved.example/h", "new", ["*"], 0.5, 100)
    audit = audit_rows(engine, "endpoint.update")
    assert [a["details"] for a in audit] == [
        {"changed": {"timeout_seconds": 0.5, "max_attempts": 1}, "before": {}},
        {"changed": {"max_attempts": 100}, "before": {}},
        {"changed": {"description": "new"}, "before": {"description": "old"}},
        {
            "changed": {"url": "http://moved.example/h", "event_types": ["*"]},
            "before": {"url": URL, "event_types": ["order.*"]},
        },
    ]
    assert audit[2] == {
        "actor": "erin",
        "action": "endpoint.update",
        "target_type": "endpoint",
        "target_id": uid,
        "reason": "renamed",
        "details": audit[2]["details"],
        "request_id": "req-2",
        "tenant_uid": "default",
    }


def test_rotate_secret_keeps_the_scheme_and_audits_the_grace(
    engine: Engine, box: SecretBox, clock: ManualClock
) -> None:
    hmac = add_endpoint(engine, box, URL).endpoint.uid
    edwards = add_endpoint(engine, box, URL, signature="ed25519").endpoint.uid
    now = clock.now()
    with engine.begin() as conn:
        with refused(EndpointError, "the grace period cannot be negative"):
            endpoint_ops.rotate_secret(
                conn, box, hmac, actor="r", now=now, grace=dt.timedelta(seconds=-1)
            )
        with refused(
            EndpointError,
            "a signing secret is 'whsec_' followed by base64, e.g. from `outbox endpoints add`",
        ):
            endpoint_ops.rotate_secret(
                conn, box, hmac, actor="r", now=now, grace=dt.timedelta(0), secret="whsec_!!!"
            )
        for secret in (None, generate_secret()):
            with refused(
                EndpointNotFoundError,
                "no endpoint 'ep_nope'; `outbox endpoints list` shows the ids",
            ):
                endpoint_ops.rotate_secret(
                    conn, box, "ep_nope", actor="r", now=now, grace=dt.timedelta(0), secret=secret
                )
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0

    old_secret = _stored_secret(engine, box, hmac, "signing_secret")
    given = generate_secret()
    with engine.begin() as conn:
        # A zero grace is allowed: the old secret stops signing at once.
        now_only = endpoint_ops.rotate_secret(
            conn, box, hmac, actor="rita", now=now, grace=dt.timedelta(0), secret=given,
            reason="leaked", request_id="req-3",
        )  # fmt: skip
        assert now_only.endpoint == get_endpoint(conn, hmac)
    assert (now_only.secret, now_only.previous_expires_at) == (given, now)
    assert _stored_secret(engine, box, hmac, "signing_secret") == given
    assert _stored_secret(engine, box, hmac, "previous_signing_secret") == old_secret
    assert (
        scalar(engine, "SELECT previous_secret_expires_at FROM endpoints WHERE uid = :u", u=hmac)
        == now
    )

    hour = dt.timedelta(hours=1)
    with engine.begin() as conn:
        kept = endpoint_ops.rotate_secret(conn, box, edwards, actor="rita", now=now, grace=hour)
        switched = endpoint_ops.rotate_secret(
            conn, box, edwards, actor="rita", now=now, grace=hour, signature="hmac"
        )
    assert kept.secret.startswith("whsk_") and kept.endpoint.signature_scheme == "ed25519"
    assert switched.secret.startswith("whsec_") and switched.endpoint.signature_scheme == "hmac"
    assert switched.previous_expires_at == now + hour
    assert audit_rows(engine, "endpoint.rotate_secret") == [
        {
            "actor": "rita",
            "action": "endpoint.rotate_secret",
            "target_type": "endpoint",
            "target_id": uid,
            "reason": reason,
            "details": {
                "previous_expires_at": (now + grace).isoformat(),
                "signature_scheme": scheme,
            },
            "request_id": request_id,
            "tenant_uid": "default",
        }
        for uid, grace, scheme, reason, request_id in (
            (hmac, dt.timedelta(0), "hmac", "leaked", "req-3"),
            (edwards, hour, "ed25519", None, None),
            (edwards, hour, "hmac", None, None),
        )
    ]


async def test_delete_endpoint_refuses_pending_work_unless_forced_and_audits_the_counts(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
    uid = add_endpoint(engine, box, URL, tenant="acme").endpoint.uid
    ids = await deliveries_in(
        engine, async_engine, clock, uid, ["scheduled", "in_flight", "dead", "succeeded"],
        tenant="acme",
    )  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at,"
                " duration_ms, outcome, worker_id) VALUES (:id, 1, now(), 20, 'permanent', 'w1')"
            ),
            {"id": ids[2]},
        )
    with engine.begin() as conn:
        with refused(
            OperationError,
            "deleting an endpoint needs a reason (--reason TEXT): it goes in the audit log",
        ):
            endpoint_ops.delete_endpoint(conn, uid, actor="d", reason=None, force=True)
        with refused(
            EndpointError,
            f"endpoint {uid} has 2 pending deliveries: discard them, or disable the endpoint"
            " instead, or pass --force to delete them too",
        ):
            endpoint_ops.delete_endpoint(conn, uid, actor="d", reason="gone")
        with refused(
            EndpointNotFoundError, f"no endpoint {uid!r}; `outbox endpoints list` shows the ids"
        ):
            endpoint_ops.delete_endpoint(
                conn, uid, actor="d", reason="gone", force=True, scope="default"
            )
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 4
    with engine.begin() as conn:
        result = endpoint_ops.delete_endpoint(
            conn, uid, actor="dan", reason=" partner left ", force=True, request_id="req-4",
            scope="acme",
        )  # fmt: skip
    assert result == {"deliveries": 4, "attempts": 1}
    assert scalar(engine, "SELECT count(*) FROM deliveries") == 0
    assert audit_rows(engine, "endpoint.delete") == [
        {
            "actor": "dan",
            "action": "endpoint.delete",
            "target_type": "endpoint",
            "target_id": uid,
            "reason": "partner left",
            "details": {"deliveries": 4, "attempts": 1, "pending": 2, "forced": True},
            "request_id": "req-4",
            "tenant_uid": "acme",
        }
    ]


def test_endpoint_actions_cannot_reach_another_tenants_endpoint(
    engine: Engine, box: SecretBox, clock: ManualClock
) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        create_tenant(conn, "globex")
    uid = add_endpoint(engine, box, URL, tenant="acme").endpoint.uid
    missing = f"no endpoint {uid!r}; `outbox endpoints list` shows the ids"
    hour = dt.timedelta(hours=1)
    before = rows(engine, "SELECT * FROM endpoints")
    with engine.begin() as conn:
        with refused(EndpointNotFoundError, missing):
            endpoint_ops.update_endpoint(conn, uid, actor="g", description="x", scope="globex")
        for secret in (None, generate_secret()):
            with refused(EndpointNotFoundError, missing):
                endpoint_ops.rotate_secret(
                    conn, box, uid, actor="g", now=clock.now(), grace=hour, secret=secret,
                    scope="globex",
                )  # fmt: skip
        with refused(EndpointNotFoundError, missing):
            endpoint_ops.delete_endpoint(conn, uid, actor="g", reason="x", scope="globex")
    assert rows(engine, "SELECT * FROM endpoints") == before
    assert scalar(engine, "SELECT count(*) FROM audit_log") == 0
    with engine.begin() as conn:
        assert (
            endpoint_ops.update_endpoint(
                conn, uid, actor="a", description="x", scope="acme"
            ).description
            == "x"
        )
        rotated = endpoint_ops.rotate_secret(
            conn, box, uid, actor="a", now=clock.now(), grace=hour, scope="acme"
        )
    assert _stored_secret(engine, box, uid, "signing_secret") == rotated.secret


def test_list_audit_filters_pages_and_shows_each_field(engine: Engine, clock: ManualClock) -> None:
    with engine.begin() as conn:
        create_tenant(conn, "acme")
        record_audit_many(
            conn,
            actor="bulk",
            action="delivery.discard",
            target_type="delivery",
            targets=[(str(n), {"n": n}) for n in range(50)],
        )
        record_audit(
            conn, actor="ann", action="delivery.replay", target_type="delivery", target_id="7",
            reason="fixed", details={"replay_id": 8}, request_id="req-5", tenant="acme",
        )  # fmt: skip
        record_audit(
            conn, actor="bob", action="deliveryish", target_type="delivery", target_id="900"
        )
        record_audit(conn, actor="ann", action="endpoint.update", target_type="endpoint",
                     target_id="ep_1")  # fmt: skip
        long_ago = clock.now() - dt.timedelta(days=3)
        conn.execute(text("UPDATE audit_log SET at = :at WHERE actor = 'bulk'"), {"at": long_ago})
        conn.execute(
            text("UPDATE audit_log SET at = :at WHERE actor <> 'bulk'"), {"at": clock.now()}
        )
    ids = [r["id"] for r in rows(engine, "SELECT id FROM audit_log ORDER BY id DESC")]
    replay_id, odd_id, update_id = ids[2], ids[1], ids[0]

    def listed(**kwargs: Any) -> list[int]:
        with engine.connect() as conn:
            return [entry.id for entry in audit_ops.list_audit(conn, **kwargs)]

    assert listed() == ids[:50]  # newest first, 50 by default
    assert listed(limit=1) == ids[:1]
    assert listed(limit=audit_ops.MAX_AUDIT_PAGE) == ids
    for wrong in (0, audit_ops.MAX_AUDIT_PAGE + 1):
        with engine.connect() as conn, refused(OperationError, "limit must be between 1 and 1000"):
            audit_ops.list_audit(conn, limit=wrong)
    assert listed(actor="ann") == [update_id, replay_id]
    assert listed(action="delivery", limit=3) == [replay_id, ids[3], ids[4]]  # not 'deliveryish'
    assert listed(action="deliveryish") == [odd_id]
    assert listed(target_id="900") == [odd_id]
    assert listed(since=clock.now() - dt.timedelta(days=1)) == [update_id, odd_id, replay_id]
    assert listed(before_id=odd_id, limit=2) == [replay_id, ids[3]]
    assert listed(scope="acme") == [replay_id]
    with engine.connect() as conn:
        [entry] = audit_ops.list_audit(conn, action="delivery.replay")
    assert entry.as_json() == {
        "id": replay_id,
        "at": clock.now().isoformat(),
        "actor": "ann",
        "action": "delivery.replay",
        "target_type": "delivery",
        "target_id": "7",
        "reason": "fixed",
        "details": {"replay_id": 8},
        "request_id": "req-5",
        "tenant": "acme",
    }
