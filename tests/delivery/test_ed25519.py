"""Asymmetric signatures (Standard Webhooks v1a, ed25519): signing checked by an independent
ed25519 verification written here, the header format of the spec, end to end through the
CLI and a real receiver, rotation with overlap, and verify() with the wrong key."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re

import pytest
from click.testing import CliRunner
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.errors import SignatureMismatchError
from delivery.operator.cli import main
from delivery.receiver import Receiver
from delivery.signing import sign, signature_header, signing_key
from delivery.verify import verify
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import (
    InvalidSecretError,
    SecretBox,
    ed25519_public_key,
    generate_ed25519_secret,
)
from outbox.endpoints import create_endpoint
from outbox.errors import EndpointError
from tests.helpers import scalar
from tests.operator_helpers import deliver

# RFC 8032 section 7.1, test 1: a known seed and its public key.
RFC_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
V1A = re.compile(r"^v1a,[A-Za-z0-9+/]{86}==$")  # 64 signature bytes in base64


def independent_verify(
    public_key: str, msg_id: str, timestamp: int, body: bytes, header: str
) -> bool:
    """What a partner does with only the whpk_ key: no code of ours involved."""
    raw = base64.b64decode(public_key.removeprefix("whpk_"))
    key = Ed25519PublicKey.from_public_bytes(raw)
    content = msg_id.encode() + b"." + str(timestamp).encode() + b"." + body
    for signature in header.split(" "):
        version, _, encoded = signature.partition(",")
        if version != "v1a":
            continue
        try:
            key.verify(base64.b64decode(encoded), content)
            return True
        except InvalidSignature:
            continue
    return False


def test_key_format_and_a_known_vector() -> None:
    secret = "whsk_" + base64.b64encode(RFC_SEED).decode()
    assert ed25519_public_key(secret) == "whpk_" + base64.b64encode(RFC_PUBLIC).decode()
    # libsodium's 64-byte form (seed || public key) names the same key.
    assert ed25519_public_key("whsk_" + base64.b64encode(RFC_SEED + RFC_PUBLIC).decode()) == (
        ed25519_public_key(secret)
    )
    with pytest.raises(InvalidSecretError, match="second half is not its public key"):
        signing_key("whsk_" + base64.b64encode(RFC_SEED + bytes(32)).decode())
    with pytest.raises(InvalidSecretError, match="decodes to 5 bytes"):
        signing_key("whsk_" + base64.b64encode(b"short").decode())
    # RFC 8032 test 1 signs the empty message; ed25519 is deterministic, so this pins
    # the signing primitive itself.
    expected = (
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39"
        "701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    assert Ed25519PrivateKey.from_private_bytes(RFC_SEED).sign(b"").hex() == expected

    body = b'{"type":"order.created","timestamp":"2026-01-01T00:00:00Z","data":{"id":1}}'
    signature = sign(signing_key(secret), "msg_abc", 1_767_225_600, body)
    assert V1A.match(signature)
    public = ed25519_public_key(secret)
    assert independent_verify(public, "msg_abc", 1_767_225_600, body, signature)
    assert not independent_verify(public, "msg_abc", 1_767_225_601, body, signature)
    assert not independent_verify(public, "msg_abc", 1_767_225_600, body + b" ", signature)


def test_verify_accepts_both_schemes_and_refuses_the_wrong_key() -> None:
    # The real time: the independent library below checks timestamps against its own clock.
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    timestamp = int(now.timestamp())
    body = b'{"type":"a.b","timestamp":"2026-01-01T00:00:00Z","data":{}}'
    ed_secret, hmac_secret = generate_ed25519_secret(), "whsec_" + base64.b64encode(
        bytes(range(32))
    ).decode()  # fmt: skip
    header = signature_header(
        [signing_key(hmac_secret), signing_key(ed_secret)], "msg_1", timestamp, body
    )
    v1, v1a = header.split(" ")
    assert v1.startswith("v1,") and V1A.match(v1a)
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": header,
    }
    assert verify(ed25519_public_key(ed_secret), headers, body, now=now)["type"] == "a.b"
    assert verify(hmac_secret, headers, body, now=now)["type"] == "a.b"
    wrong = ed25519_public_key(generate_ed25519_secret())
    with pytest.raises(SignatureMismatchError, match="no v1a signature"):
        verify(wrong, headers, body, now=now)
    # A v1 signature never satisfies a public key, and tampering is caught.
    only_v1 = {**headers, "webhook-signature": v1}
    with pytest.raises(SignatureMismatchError):
        verify(ed25519_public_key(ed_secret), only_v1, body, now=now)
    with pytest.raises(SignatureMismatchError):
        verify(ed25519_public_key(ed_secret), headers, body + b"x", now=now)
    with pytest.raises(InvalidSecretError, match="whpk_"):
        verify("whpk_AAAA", headers, body, now=now)
    # An independent Standard Webhooks library checks the v1 half the same way.
    from standardwebhooks.webhooks import Webhook

    assert Webhook(hmac_secret).verify(body, headers) is not None


def test_a_scheme_and_a_secret_that_disagree_are_refused(engine: Engine, box: SecretBox) -> None:
    with engine.begin() as conn, pytest.raises(EndpointError, match="needs a whsk_ secret key"):
        create_endpoint(
            conn,
            box,
            url="https://example.com/h",
            event_types="*",
            secret="whsec_" + base64.b64encode(bytes(32)).decode(),
            signature="ed25519",
        )
    assert scalar(engine, "SELECT count(*) FROM endpoints") == 0


async def test_end_to_end_through_the_cli_with_rotation(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    receiver: Receiver,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "k1:" + base64.b64encode(bytes(range(32))).decode()
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", key)
    box = SecretBox.from_setting(key)
    cli = CliRunner()
    added = cli.invoke(
        main,
        ["endpoints", "add", receiver.route("/ed"), "--events", "*", "--signature", "ed25519",
         "--json"],
        catch_exceptions=False,
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    created = json.loads(added.output)
    assert created["signature_scheme"] == "ed25519" and "secret" not in created
    public = created["public_key"]
    assert re.match(r"^whpk_[A-Za-z0-9+/]{43}=$", public)
    stored = scalar(engine, "SELECT signing_secret FROM endpoints")
    assert stored.startswith("v1:k1:") and "whsk_" not in stored  # encrypted at rest
    listed = json.loads(cli.invoke(main, ["endpoints", "list", "--json"]).output)
    assert listed[0]["public_key"] == public

    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 1})
    await deliver(async_engine, box, clock)
    [request] = receiver.received("/ed")
    headers = request.headers
    assert V1A.match(headers["webhook-signature"])
    assert independent_verify(
        public, headers["webhook-id"], int(headers["webhook-timestamp"]), request.body,
        headers["webhook-signature"],
    )  # fmt: skip
    assert verify(public, headers, request.body)["data"] == {"id": 1}

    # Rotate to a new ed25519 key: during the grace both signatures are sent.
    rotated = cli.invoke(
        main,
        ["endpoints", "rotate-secret", created["id"], "--grace", "1h", "--json"],
        catch_exceptions=False,
    )
    new_public = json.loads(rotated.output)["public_key"]
    assert new_public != public and "secret" not in json.loads(rotated.output)
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 2})
    await deliver(async_engine, box, clock)
    second = receiver.received("/ed")[1]
    signatures = second.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(V1A.match(s) for s in signatures)
    for which in (public, new_public):
        assert verify(which, second.headers, second.body)["data"] == {"id": 2}

    # And back to HMAC: the header carries v1 (new) and v1a (old) until the grace ends.
    back = cli.invoke(
        main,
        ["endpoints", "rotate-secret", created["id"], "--signature", "hmac", "--json"],
        catch_exceptions=False,
    )
    hmac_secret = json.loads(back.output)["secret"]
    with engine.begin() as conn:
        publish(conn, "order.created", {"id": 3})
    await deliver(async_engine, box, clock)
    third = receiver.received("/ed")[2]
    assert verify(hmac_secret, third.headers, third.body)["data"] == {"id": 3}
    assert verify(new_public, third.headers, third.body)["data"] == {"id": 3}
    with pytest.raises(SignatureMismatchError):
        verify(public, third.headers, third.body)  # the first key's grace was replaced
