"""The plumbing of the console and portal pages: templates, security headers, cookies,
sessions, CSRF, and the wrapper every page goes through (role, CSRF, errors).

Security: sessions live in HttpOnly SameSite cookies (Secure over HTTPS), tokens never
appear in a URL, every state change needs the session's CSRF token, the
Content-Security-Policy allows scripts and styles from this origin only (no inline code),
templates escape every value, and framing is refused except by the configured origins.
Refused input is a 400 page that says why; anything else a page raises is our bug, a 500
whose traceback is logged under the request id the page shows (and `x-request-id`).
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from delivery.operator.console.config import ConsoleConfig
from delivery.operator.console.sessions import WebSession, load_session
from delivery.operator.context import OperatorContext
from delivery.operator.refusals import UnauthenticatedLimiter, client_address
from outbox.errors import NotFoundError, OutboxError
from outbox.wording import plural

log = logging.getLogger("delivery.operator.console")
HERE = Path(__file__).resolve().parent
CONSOLE_COOKIE = "obx_console"
PORTAL_COOKIE = "obx_portal"
REQUEST_ID_HEADER = "x-request-id"


class PageError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


Page = Callable[[Request, WebSession], Awaitable[Response]]


class ConsoleBase:
    """What every page of the console and the portal shares, over the operator context."""

    def __init__(self, context: OperatorContext, config: ConsoleConfig | None = None) -> None:
        self.context = context
        self.config = config or ConsoleConfig()
        # the admin API's limiter: a token bucket per client, least recently seen forgotten
        self.limiter = UnauthenticatedLimiter(self.config.logins_per_minute)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters["when"] = moment
        self.env.filters["ms"] = _ms
        self.env.filters["pct"] = _pct
        self.env.filters["plural"] = plural
        self.env.filters["code"] = code_spans
        # Readable JSON; the template's autoescaping then makes it safe HTML.
        self.env.filters["pretty"] = _pretty

    # -- plumbing -------------------------------------------------------------------------

    def render(
        self, request: Request, template: str, status: int = 200, **context: Any
    ) -> Response:
        context.setdefault("session", None)
        body = self.env.get_template(template).render(
            request=request, config=self.config, **context
        )
        session = context.get("session")
        portal = template.startswith("portal/") or getattr(session, "kind", None) == "portal"
        return self.secure(HTMLResponse(body, status), portal=portal)

    def secure(self, response: Response, *, portal: bool = False) -> Response:
        origins = " ".join(self.config.frame_origins) if portal else ""
        ancestors = origins or "'none'"
        response.headers["content-security-policy"] = (
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; form-action 'self'; base-uri 'none'; "
            f"frame-ancestors {ancestors}"
        )
        if not origins:
            response.headers["x-frame-options"] = "DENY"
        response.headers["x-content-type-options"] = "nosniff"
        response.headers["referrer-policy"] = "same-origin"
        response.headers["cache-control"] = "no-store"
        return response

    def _cookie(self, response: Response, request: Request, name: str, value: str) -> None:
        https = request.url.scheme == "https"
        # The portal is embedded cross-site only from configured origins; that needs
        # SameSite=None, which browsers accept only with Secure (HTTPS).
        cross_site = name == PORTAL_COOKIE and bool(self.config.frame_origins) and https
        ttl = self.config.portal_session_ttl if name == PORTAL_COOKIE else self.config.session_ttl
        response.set_cookie(
            name,
            value,
            max_age=int(ttl.total_seconds()),
            path="/portal" if name == PORTAL_COOKIE else "/console",
            httponly=True,
            secure=https,
            samesite="none" if cross_site else ("lax" if name == PORTAL_COOKIE else "strict"),
        )

    def _client(self, request: Request) -> str:
        return client_address(request) or "unknown"

    async def _refused_sign_in(self, request: Request, key: str, why: str) -> None:
        """Audit a failed sign-in like a refused API call: aggregated per client and reason
        (with the client's 429s since its last written refusal), so a flood of guesses
        costs a bounded number of rows (see delivery.operator.refusals)."""
        await self.context.record_refused(
            request,
            request_id=uuid.uuid4().hex,
            status=401,
            why=why,
            actor="anonymous",
            limited=self.limiter.limited_since_written(key),
        )

    async def _session(self, request: Request, kind: str) -> WebSession | None:
        cookie = request.cookies.get(CONSOLE_COOKIE if kind == "console" else PORTAL_COOKIE, "")
        if not cookie:
            return None
        now = self.context.clock.now()
        return await self.context.read(lambda c: load_session(c, cookie, kind=kind, now=now))

    async def _check_csrf(self, request: Request, session: WebSession) -> dict[str, str]:
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        presented = request.headers.get("x-csrf-token") or fields.get("csrf", "")
        if not hmac.compare_digest(presented.encode(), session.csrf_token.encode()):
            raise PageError(403, "the form expired or did not come from this console; reload")
        origin = request.headers.get("origin")
        if origin and origin != f"{request.url.scheme}://{request.url.netloc}":
            raise PageError(403, "cross-origin form refused")
        return fields

    def page(self, kind: str, handler: Page, *, act: bool = False) -> Callable[..., Any]:
        """Wrap a handler: load the session, check role and CSRF, render errors."""

        async def endpoint(request: Request) -> Response:
            session = await self._session(request, kind)
            if session is None:
                if kind == "console":
                    return self.secure(RedirectResponse("/console/login", 303))
                return self.render(
                    request,
                    "portal/expired.html",
                    401,
                    message="This portal session has ended. Ask for a new link.",
                )
            try:
                if request.method == "POST":
                    if act and not session.can_act:
                        raise PageError(403, "your role can look but not act")
                    request.state.form = await self._check_csrf(request, session)
                return await handler(request, session)
            except PageError as exc:
                return self.render(
                    request, "error.html", exc.status, session=session, message=exc.message
                )
            except NotFoundError as exc:
                return self.render(request, "error.html", 404, session=session, message=str(exc))
            except OutboxError as exc:
                return self.render(request, "error.html", 400, session=session, message=str(exc))
            except Exception:
                # Our bug, not the user's: the traceback is logged under a request id the
                # page shows, nothing of the internals.
                request_id = uuid.uuid4().hex
                log.exception("console %s %s failed (request id %s)", request.method,
                              request.url.path, request_id)  # fmt: skip
                response = self.render(
                    request,
                    "error.html",
                    500,
                    session=session,
                    message=f"Something went wrong on our side (request id {request_id}).",
                )
                response.headers[REQUEST_ID_HEADER] = request_id
                return response

        return endpoint


def moment(value: dt.datetime | str | None) -> str:
    """A moment as a UTC date and time to the second (the pages state times, not ages);
    ISO text (attempts come as JSON-ready dicts) reads the same way."""
    if value is None:
        return "-"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


_CODE = Markup("<code>{}</code>")


def code_spans(value: object) -> Markup:
    """Escaped text whose `backticked` parts (messages shared with the CLI) become <code>;
    an unpaired backtick stays as it is."""
    parts = str(value).split("`")
    if len(parts) % 2 == 0:
        return escape(value)
    return Markup("").join(
        _CODE.format(part) if index % 2 else escape(part) for index, part in enumerate(parts)
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"
