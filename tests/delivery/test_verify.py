"""Receiver-side verification, including interop both ways with `standardwebhooks`."""

from __future__ import annotations

import datetime as dt
import json
import time

import httpx
import pytest
from standardwebhooks import Webhook

from delivery.errors import DeliveryError
from delivery.signing import (
    InvalidSecretError,
    generate_secret,
    secret_key_bytes,
    sign,
    signature_header,
)
from delivery.verify import (
    InvalidPayloadError,
    MissingHeaderError,
    SignatureMismatchError,
    TimestampError,
    WebhookVerificationError,
    verify,
)

SECRET = generate_secret()
OLD_SECRET = generate_secret()
NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
TS = int(NOW.timestamp())
MSG_ID = "msg_2f1b7c1e"
BODY = json.dumps({"type": "order.created", "data": {"id": "ord_1", "name": "Zoë"}}).encode()


def signed_headers(
    secrets: list[str] | None = None,
    *,
    msg_id: str = MSG_ID,
    ts: int = TS,
    body: bytes = BODY,
) -> dict[str, str]:
    keys = [secret_key_bytes(s) for s in (secrets or [SECRET])]
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature_header(keys, msg_id, ts, body),
    }


def test_a_correctly_signed_webhook_returns_its_event() -> None:
    assert verify(SECRET, signed_headers(), BODY, now=NOW) == json.loads(BODY)


def test_a_str_body_verifies_like_its_utf8_bytes() -> None:
    assert verify(SECRET, signed_headers(), BODY.decode(), now=NOW)["data"]["name"] == "Zoë"


def test_headers_are_case_insensitive_and_any_mapping_works() -> None:
    headers = {k.upper() if "id" in k else k.title(): v for k, v in signed_headers().items()}
    assert verify(SECRET, headers, BODY, now=NOW)["type"] == "order.created"
    assert verify(SECRET, httpx.Headers(signed_headers()), BODY, now=NOW)["type"]


# ----------------------------------------------------------------------------- interop


def test_standardwebhooks_signature_verifies_with_ours() -> None:
    theirs = Webhook(SECRET).sign(MSG_ID, NOW, BODY.decode())
    headers = {"webhook-id": MSG_ID, "webhook-timestamp": str(TS), "webhook-signature": theirs}
    assert verify(SECRET, headers, BODY, now=NOW) == json.loads(BODY)
    assert theirs == sign(secret_key_bytes(SECRET), MSG_ID, TS, BODY)


def test_our_signature_verifies_with_standardwebhooks() -> None:
    # Their verify() reads the wall clock, so this one test signs "now".
    ts = int(time.time())
    headers = signed_headers(ts=ts)
    assert Webhook(SECRET).verify(BODY, headers) == json.loads(BODY)
    assert Webhook(SECRET).verify(BODY.decode(), headers) == json.loads(BODY)


def test_our_rotation_header_verifies_with_standardwebhooks_for_either_secret() -> None:
    ts = int(time.time())
    headers = signed_headers([SECRET, OLD_SECRET], ts=ts)
    assert Webhook(SECRET).verify(BODY, headers) == json.loads(BODY)
    assert Webhook(OLD_SECRET).verify(BODY, headers) == json.loads(BODY)


# ---------------------------------------------------------------------------- rotation


def test_either_signature_of_a_rotating_endpoint_is_accepted() -> None:
    headers = signed_headers([SECRET, OLD_SECRET])
    assert len(headers["webhook-signature"].split(" ")) == 2
    assert verify(SECRET, headers, BODY, now=NOW)
    assert verify(OLD_SECRET, headers, BODY, now=NOW)
    with pytest.raises(SignatureMismatchError):
        verify(generate_secret(), headers, BODY, now=NOW)


def test_unknown_versions_and_malformed_entries_are_skipped() -> None:
    valid = signed_headers()["webhook-signature"]
    mac = valid.split(",", 1)[1]
    headers = signed_headers()
    headers["webhook-signature"] = f"v2,{mac} v1a,AAAA garbage v1,!!notbase64!! v1, {valid}"
    assert verify(SECRET, headers, BODY, now=NOW)
    headers["webhook-signature"] = f"v2,{mac}"  # the right MAC under an unknown version
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, headers, BODY, now=NOW)


# ---------------------------------------------------------------------------- timestamp


@pytest.mark.parametrize("offset", [-300, -1, 0, 1, 300])
def test_timestamps_within_tolerance_either_way_pass(offset: int) -> None:
    headers = signed_headers(ts=TS + offset)
    assert verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize(("offset", "message"), [(-301, "old"), (301, "in the future")])
def test_timestamps_beyond_tolerance_are_refused(offset: int, message: str) -> None:
    with pytest.raises(TimestampError, match=message):
        verify(SECRET, signed_headers(ts=TS + offset), BODY, now=NOW)


def test_tolerance_is_configurable() -> None:
    headers = signed_headers(ts=TS - 3600)
    assert verify(SECRET, headers, BODY, now=NOW, tolerance=dt.timedelta(hours=1))
    with pytest.raises(TimestampError):
        verify(
            SECRET, signed_headers(ts=TS - 31), BODY, now=NOW, tolerance=dt.timedelta(seconds=30)
        )


@pytest.mark.parametrize("value", ["soon", "1.5e9", "-1", "1893499200.0", "0x70", "9" * 20])
def test_malformed_timestamps_are_refused(value: str) -> None:
    headers = signed_headers()
    headers["webhook-timestamp"] = value
    with pytest.raises(TimestampError, match="unix seconds"):
        verify(SECRET, headers, BODY, now=NOW)


def test_now_must_be_aware() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        verify(SECRET, signed_headers(), BODY, now=NOW.replace(tzinfo=None))


def test_default_now_is_the_system_clock() -> None:
    assert verify(SECRET, signed_headers(ts=int(time.time())), BODY)


# ------------------------------------------------------------------------------ tamper


def test_a_tampered_body_is_refused() -> None:
    tampered = BODY.replace(b"ord_1", b"ord_2")
    with pytest.raises(SignatureMismatchError, match="secret"):
        verify(SECRET, signed_headers(), tampered, now=NOW)


def test_the_id_and_timestamp_are_covered_by_the_signature() -> None:
    headers = signed_headers()
    headers["webhook-id"] = "msg_other"
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, headers, BODY, now=NOW)
    headers = signed_headers()
    headers["webhook-timestamp"] = str(TS + 1)
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, headers, BODY, now=NOW)


def test_the_signature_is_checked_before_the_body_is_parsed() -> None:
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, signed_headers(), b"not json", now=NOW)


# ------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_or_empty_headers_are_named(name: str) -> None:
    headers = signed_headers()
    del headers[name]
    with pytest.raises(MissingHeaderError, match=name):
        verify(SECRET, headers, BODY, now=NOW)
    headers[name] = "  "
    with pytest.raises(MissingHeaderError, match=name):
        verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"not json", "not UTF-8 JSON"), (b"\xff\xfe", "not UTF-8 JSON"), (b"[1, 2]", "JSON list")],
)
def test_signed_bodies_that_are_not_json_objects_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(InvalidPayloadError, match=message):
        verify(SECRET, signed_headers(body=body), body, now=NOW)


def test_every_failure_is_one_catchable_error() -> None:
    for error in (MissingHeaderError, TimestampError, SignatureMismatchError, InvalidPayloadError):
        assert issubclass(error, WebhookVerificationError)
    assert issubclass(WebhookVerificationError, DeliveryError)
    assert issubclass(WebhookVerificationError, ValueError)


def test_a_malformed_secret_is_a_configuration_error_not_a_verification_failure() -> None:
    with pytest.raises(InvalidSecretError):
        verify("whsec_not base64", signed_headers(), BODY, now=NOW)
    with pytest.raises(ValueError, match="negative"):
        verify(SECRET, signed_headers(), BODY, now=NOW, tolerance=dt.timedelta(seconds=-1))


# ------------------------------------------------------- exact messages, strictness (issue 15)


def test_a_zero_tolerance_accepts_the_exact_second_and_negative_is_refused() -> None:
    assert verify(SECRET, signed_headers(), BODY, now=NOW, tolerance=dt.timedelta(0))
    with pytest.raises(ValueError, match=r"^tolerance must not be negative$"):
        verify(SECRET, signed_headers(), BODY, now=NOW, tolerance=dt.timedelta(seconds=-1))
    with pytest.raises(
        ValueError, match=r"^now must be timezone-aware, e.g. datetime.now\(timezone.utc\)$"
    ):
        verify(SECRET, signed_headers(), BODY, now=NOW.replace(tzinfo=None))


def test_failure_messages_say_what_to_check() -> None:
    with pytest.raises(SignatureMismatchError) as mismatch:
        verify(OLD_SECRET, signed_headers(), BODY, now=NOW)
    assert str(mismatch.value) == (
        "no v1 signature in webhook-signature matches this body; check that the secret "
        "is this endpoint's current one and that the body is verified exactly as received"
    )
    with pytest.raises(TimestampError) as old:
        verify(SECRET, signed_headers(ts=TS - 600), BODY, now=NOW)
    assert str(old.value) == (
        "webhook-timestamp is 600s old, beyond the 300s tolerance: a replay, or this "
        "host's clock is wrong (check NTP)"
    )
    with pytest.raises(TimestampError) as junk:
        verify(SECRET, {**signed_headers(), "webhook-timestamp": "9" * 40 + "x"}, BODY, now=NOW)
    assert str(junk.value) == f"webhook-timestamp {'9' * 32!r} is not whole unix seconds"


def test_a_signature_with_stray_characters_in_its_base64_does_not_verify() -> None:
    headers = signed_headers()
    digest = headers["webhook-signature"].removeprefix("v1,")
    headers["webhook-signature"] = "v1," + digest[:4] + "!" + digest[4:]
    with pytest.raises(SignatureMismatchError):
        verify(SECRET, headers, BODY, now=NOW)
