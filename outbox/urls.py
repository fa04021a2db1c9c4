"""Endpoint URL rules, checked when an endpoint is saved (no DNS: the connect-time
SSRF guard in delivery/ssrf.py judges the address actually dialled)."""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Final

import httpx

from outbox.errors import InvalidEndpointURLError

MAX_URL_LENGTH = 2048

_WHITESPACE_OR_CONTROL = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff]")
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_HOST_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def validate_endpoint_url(url: str, *, https_only: bool = False) -> str:
    """Check an endpoint URL when it is saved and return its normal form.

    No DNS: the name may legitimately resolve differently by the time anything
    is sent, so the connect-time guard makes the address decision. Parsing uses
    httpx's own parser, so what is validated is what the worker will request.
    Numeric IPv4 spellings (`2130706433`, `0x7f000001`, `127.1`) are normalised to
    dotted form, so operators see the address they really point at.
    """
    if not isinstance(url, str):
        raise InvalidEndpointURLError(f"an endpoint URL must be a string, not {type(url).__name__}")
    if not url:
        raise InvalidEndpointURLError(
            "the endpoint URL is empty; give e.g. https://example.com/hook"
        )
    if len(url) > MAX_URL_LENGTH:
        raise InvalidEndpointURLError(
            f"the endpoint URL is {len(url)} characters; the limit is {MAX_URL_LENGTH}"
        )
    bad = _WHITESPACE_OR_CONTROL.search(url)
    if bad is not None:
        raise InvalidEndpointURLError(
            f"the endpoint URL contains whitespace or a control character "
            f"({bad.group()!r} at position {bad.start()}); percent-encode it or remove it"
        )
    schemes = ("https",) if https_only else ("http", "https")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise InvalidEndpointURLError(
            f"the endpoint URL must start with {' or '.join(s + '://' for s in schemes)}"
            + (" (this deployment only sends over https)" if https_only else "")
        )
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        raise InvalidEndpointURLError(
            "the endpoint URL must not contain credentials (user:password@); requests are "
            "authenticated by their signature, so remove them"
        )
    if "#" in url:
        raise InvalidEndpointURLError(
            "the endpoint URL must not have a #fragment; fragments are never sent, remove it"
        )
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise InvalidEndpointURLError(f"the endpoint URL is not a valid URL: {exc}") from None
    try:
        raw_host = parsed.raw_host.decode("ascii")
    except UnicodeDecodeError:  # pragma: no cover - httpx IDNA-encodes hosts to ASCII
        raise InvalidEndpointURLError("the endpoint URL's host is not ASCII") from None
    if not raw_host:
        raise InvalidEndpointURLError(
            "the endpoint URL has no host; give e.g. https://example.com/"
        )
    port = parsed.port
    if port is not None and not 1 <= port <= 65535:
        raise InvalidEndpointURLError(f"port {port} is out of range; use 1-65535")
    host = _normalise_host(raw_host)
    port_part = "" if port is None or port == _DEFAULT_PORTS[parsed.scheme] else f":{port}"
    path = parsed.raw_path.decode("ascii")
    return f"{parsed.scheme}://{host}{port_part}{path}"


def _normalise_host(host: str) -> str:
    if "%" in host:
        raise InvalidEndpointURLError(
            f"the host {host!r} contains '%': percent-encoded hosts and IPv6 zone ids "
            "are not allowed; write the plain host name or address"
        )
    if ":" in host:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidEndpointURLError(f"{host!r} is not a valid IPv6 address") from None
        # Show `[::ffff:127.0.0.1]` as the IPv4 host it reaches, like the guard judges it.
        mapped = address.ipv4_mapped
        return str(mapped) if mapped is not None else f"[{address.compressed}]"
    labels = host.removesuffix(".").split(".")
    if _NUMERIC_LABEL.match(labels[-1]):
        # WHATWG URL rule: a host whose last label is a number is an IPv4 address,
        # in any of inet_aton's spellings (which is also what getaddrinfo accepts).
        try:
            return str(ipaddress.IPv4Address(socket.inet_aton(host.removesuffix("."))))
        except OSError:
            raise InvalidEndpointURLError(
                f"the host {host!r} looks like an IPv4 address but is not one"
            ) from None
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise InvalidEndpointURLError(
            f"the host {host!r} is not a valid host name (labels of letters, digits and "
            "hyphens, each 1-63 characters)"
        )
    return host
