"""Our own HTTP/1.1 wire for webhook POSTs (moving into modules)."""

from delivery.wire.connection import (
    CONNECT_STAGGER_SECONDS,
    KEEPALIVE_EXPIRY,
    MAX_HEAD_BYTES,
    PROXY_EXTENSION,
    Trace,
    WireResponse,
    WireTransport,
)

__all__ = [
    "CONNECT_STAGGER_SECONDS",
    "KEEPALIVE_EXPIRY",
    "MAX_HEAD_BYTES",
    "PROXY_EXTENSION",
    "Trace",
    "WireResponse",
    "WireTransport",
]
