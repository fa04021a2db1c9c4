"""OAuth2 client credentials (RFC 6749 section 4.4) for endpoints that want a bearer token.

The worker fetches an access token from the endpoint's token URL through the same
guarded client as its deliveries (the SSRF guard applies, redirects are never followed,
the answer is read up to a cap) and the same egress path (the endpoint's proxy, else
OUTBOX_HTTP_PROXY: a network that lets out only its proxy lets the token request
out too), keeps it in this process until shortly before its
`expires_in`, and sends it as `Authorization: Bearer`. A failing token endpoint becomes
a `TokenError` the attempt records (never a crash, never the secret).

Outcomes, decided here: the receiver never saw the request, so every token failure is
RETRYABLE (a 5xx or an unreachable token endpoint heals by itself; a 4xx such as
`invalid_client` heals when the operator fixes the credentials, and pending deliveries
then go through instead of having died), except a token URL the SSRF guard or the scheme
rule refuses, which no retry can change: PERMANENT.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from dataclasses import dataclass
from urllib.parse import quote_plus

import httpx

from delivery.errors import AddressRefusedError, InvalidEndpointURLError
from delivery.policy import Outcome
from delivery.wire import PROXY_EXTENSION
from outbox.clock import Clock
from outbox.endpoint_auth import OAuthClient

# A token response larger than this is refused (a token answer is well under 16 KiB).
MAX_TOKEN_RESPONSE_BYTES = 64 * 1024
# A token is used until this long before it expires (or half its life, if shorter).
EXPIRY_MARGIN_SECONDS = 30.0
# Without `expires_in` a token is kept this long; longer lifetimes are capped to a day.
DEFAULT_LIFETIME_SECONDS = 60.0
MAX_LIFETIME_SECONDS = 86_400.0
# The token request's own deadline, when the attempt's is longer.
TOKEN_TIMEOUT_SECONDS = 10.0
# How an attempt's error starts when it got no token (the console finds them by it).
OAUTH_FAILURE_PREFIX = "no OAuth access token: "


class TokenError(Exception):
    """The token endpoint gave no usable token: `outcome` is what the attempt becomes."""

    def __init__(self, message: str, outcome: Outcome = Outcome.RETRYABLE) -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclass(slots=True)
class _Cached:
    token: str
    good_until: dt.datetime


class TokenCache:
    """Access tokens per set of client credentials, in this process, until shortly before
    they expire. One fetch at a time per credentials: concurrent attempts wait for it."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._tokens: dict[str, _Cached] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.fetches = 0  # token requests made (for tests and metrics)

    async def token(
        self,
        client: httpx.AsyncClient,
        oauth: OAuthClient,
        *,
        within: float,
        stale: str | None = None,
        proxy: str | None = None,
    ) -> tuple[str, bool]:
        """(access token, whether it was fetched now). `stale`: a token the receiver
        refused (401), replaced unless another attempt already did. `proxy`: the
        endpoint's own egress proxy, which the token request takes like the delivery
        (without one, the client's default proxy, if any)."""
        key = oauth.cache_key
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if (
                cached is not None
                and cached.token != stale
                and cached.good_until > self._clock.now()
            ):
                return cached.token, False
            self._tokens.pop(key, None)
            token, lifetime = await self._fetch(client, oauth, within=within, proxy=proxy)
            margin = min(EXPIRY_MARGIN_SECONDS, lifetime / 2)
            self._tokens[key] = _Cached(
                token, self._clock.now() + dt.timedelta(seconds=lifetime - margin)
            )
            return token, True

    async def _fetch(
        self, client: httpx.AsyncClient, oauth: OAuthClient, *, within: float, proxy: str | None
    ) -> tuple[str, float]:
        self.fetches += 1
        within = min(within, TOKEN_TIMEOUT_SECONDS)
        form = {"grant_type": "client_credentials"}
        if oauth.scope:
            form["scope"] = oauth.scope
        where = f"the OAuth token endpoint {oauth.token_url}"
        request = client.build_request(
            "POST",
            oauth.token_url,
            data=form,
            headers={"accept": "application/json"},
            timeout=within,
            extensions={} if proxy is None else {PROXY_EXTENSION: proxy},
        )
        # HTTP Basic with form-urlencoded id and secret (RFC 6749 section 2.3.1).
        pair = f"{quote_plus(oauth.client_id)}:{quote_plus(oauth.client_secret)}"
        request.headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        try:
            async with asyncio.timeout(within):
                response = await client.send(request, stream=True, follow_redirects=False)
                try:
                    body = bytearray()
                    async for chunk in response.aiter_raw():
                        body += chunk
                        if len(body) > MAX_TOKEN_RESPONSE_BYTES:
                            raise TokenError(
                                f"{where} answered with more than "
                                f"{MAX_TOKEN_RESPONSE_BYTES} bytes; not a token response"
                            )
                finally:
                    await response.aclose()
        except (AddressRefusedError, InvalidEndpointURLError) as exc:
            raise TokenError(f"{where} is refused: {exc}", Outcome.PERMANENT) from exc
        except TimeoutError as exc:
            raise TokenError(f"{where} did not answer within {within:g}s") from exc
        except httpx.HTTPError as exc:
            raise TokenError(f"{where} is unreachable: {type(exc).__name__}: {exc}") from exc
        return parse_token_response(response.status_code, bytes(body), where)


def parse_token_response(status: int, body: bytes, where: str) -> tuple[str, float]:
    """(access token, lifetime in seconds) from a token endpoint's answer (RFC 6749
    section 5.1), or TokenError saying what is wrong (with the RFC error code, if any)."""
    if status != 200:
        detail = _oauth_error(body)
        hint = (
            "; check the endpoint's OAuth client id and secret" if status in (400, 401, 403) else ""
        )
        raise TokenError(f"{where} answered HTTP {status}{detail}{hint}")
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise TokenError(f"{where} answered 200 with a body that is not JSON") from exc
    token = answer.get("access_token") if isinstance(answer, dict) else None
    if not isinstance(token, str) or not token:
        raise TokenError(f"{where} answered 200 without an access_token")
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in token):
        raise TokenError(f"{where} gave an access token with characters a header cannot hold")
    expires = answer.get("expires_in", DEFAULT_LIFETIME_SECONDS)
    if isinstance(expires, str) and expires.isascii() and expires.isdigit():
        expires = int(expires)
    if (
        isinstance(expires, bool)
        or not isinstance(expires, (int, float))
        or not 0 < expires < float("inf")
    ):
        expires = DEFAULT_LIFETIME_SECONDS
    return token, min(float(expires), MAX_LIFETIME_SECONDS)


def _oauth_error(body: bytes) -> str:
    """' (invalid_client: ...)' from an RFC 6749 error answer, else ''."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(answer, dict) or not isinstance(answer.get("error"), str):
        return ""
    described = answer.get("error_description")
    text = answer["error"] + (f": {described}" if isinstance(described, str) else "")
    return f" ({' '.join(text.split())[:200]})"
