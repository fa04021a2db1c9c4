"""Public identifiers: time-ordered, URL-safe and prefixed so a human can tell what they name."""

from __future__ import annotations

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): millisecond timestamp first, so ids sort by creation time.

    The timestamp only orders ids; it is never used as the event's time, so reading
    the wall clock here does not break injected time.
    """
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    return uuid.UUID(int=value)


def new_message_id() -> str:
    """The public id of an event; it becomes the `webhook-id` header."""
    return "msg_" + uuid7().hex


def new_endpoint_id() -> str:
    return "ep_" + uuid7().hex
