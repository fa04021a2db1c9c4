"""Endpoint and proxy URL rules, checked when saved (no DNS: the connect-time SSRF guard
in delivery/ssrf.py judges the address actually dialled)."""

from __future__ import annotations

import base64
import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Final

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
    import httpx  # the sender's parser: only saving an endpoint needs it, not publish()

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


@dataclass(frozen=True, slots=True)
class ProxyURL:
    """An egress proxy, parsed: where to connect and the credentials to present.

    The credentials are a secret: `repr` and `display` leave them out, so the proxy can be
    named in errors and logs as `host:port` only.
    """

    host: str
    port: int
    username: str = field(default="", repr=False)
    password: str = field(default="", repr=False)

    @property
    def display(self) -> str:
        """`host:port`, never the credentials: what errors, logs and the API show."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def authorization(self) -> str | None:
        """The `Proxy-Authorization` value (Basic) when the URL carries credentials."""
        if not self.username and not self.password:
            return None
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode("ascii")
        return f"Basic {token}"


def parse_proxy_url(url: str, *, what: str = "the proxy URL") -> ProxyURL:
    """`http://user:password@host:port` -> ProxyURL, or a clear error naming `what` is wrong.

    Only `http://` proxies (HTTPS targets go through `CONNECT`, so TLS is end to end
    anyway); the port is required, there is no convention to guess it from. The error
    never repeats the URL itself: it may carry a password.
    """
    if not isinstance(url, str) or not url:
        raise InvalidEndpointURLError(
            f"{what} is empty; give e.g. http://user:password@proxy.internal:3128"
        )
    if len(url) > MAX_URL_LENGTH or _WHITESPACE_OR_CONTROL.search(url):
        raise InvalidEndpointURLError(
            f"{what} is over {MAX_URL_LENGTH} characters or contains whitespace or a control "
            "character; percent-encode special characters in the user name and password"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "http":
        raise InvalidEndpointURLError(
            f"{what} must start with http:// (an HTTP proxy; https targets are tunnelled "
            "through CONNECT, so TLS stays end to end)"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidEndpointURLError(
            f"{what} must be only http://[user:password@]host:port, without a path or query"
        )
    try:
        port = parts.port
    except ValueError:
        raise InvalidEndpointURLError(f"{what} has an invalid port; use 1-65535") from None
    if port is None or not 1 <= port <= 65535:
        raise InvalidEndpointURLError(
            f"{what} needs the proxy's port, e.g. http://proxy.internal:3128"
        )
    host = parts.hostname or ""
    if not host:
        raise InvalidEndpointURLError(f"{what} has no host; e.g. http://proxy.internal:3128")
    host = _normalise_host(host).strip("[]")
    username = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    if ":" in username or any(ch in username + password for ch in "\r\n\x00"):
        raise InvalidEndpointURLError(
            f"{what} has a user name with ':' or credentials with a line break or NUL"
        )
    return ProxyURL(host=host, port=port, username=username, password=password)
