"""The operator console (/console) and the tenant portal (/portal): server-rendered pages.

Pages are Jinja2 templates (files in templates/) with htmx for partial updates and uPlot
for charts, both shipped in static/ (no CDN: it works offline and behind firewalls). The
data comes from the same functions the CLI and the admin API call, so the three never
disagree. The plumbing (headers, cookies, sessions, CSRF, errors) is in base.py.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from delivery.operator.console import charts, queries, scoped
from delivery.operator.console.base import (
    CONSOLE_COOKIE,
    HERE,
    PORTAL_COOKIE,
    PageError,
    moment,
)
from delivery.operator.console.deliveries import DeliveryPages
from delivery.operator.console.sessions import (
    WebSession,
    close_session,
    issue_portal_link,
    open_session,
    portal_link,
    redeem_portal_link,
)
from outbox import deliveries as delivery_ops
from outbox.errors import NotFoundError
from outbox.tokens import TokenRefusedError, authenticate

# Reasons of refused sign-ins in the audit log (never what was presented).
SIGN_IN_REFUSED = "console sign-in: unknown or revoked token"
LINK_REFUSED = "portal sign-in: unknown, used or expired link"


class Console(DeliveryPages):
    """Routes of the console and the portal, on the shared operator context."""

    # -- login ----------------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        return self.render(request, "login.html", session=None, error=None)

    async def login(self, request: Request) -> Response:
        now = self.context.clock.now()
        key = f"login:{self._client(request)}"
        wait = self.limiter.take(key, now)
        if wait is not None:
            return self.render(
                request,
                "login.html",
                429,
                session=None,
                error=f"Too many attempts; try again in {wait:.0f} s.",
            )
        form = await request.form()
        presented = str(form.get("token") or "")

        refused = SIGN_IN_REFUSED

        def sign_in(conn: Connection) -> tuple[str, WebSession] | None:
            nonlocal refused
            try:
                principal = authenticate(conn, presented, now=now)
            except TokenRefusedError as exc:
                # its tenant was deleted or it expired: unknown, as far as signing in goes
                refused = f"console sign-in: {exc}"
                return None
            if principal is None:
                return None
            return open_session(
                conn,
                kind="console",
                actor=principal.actor,
                role=principal.role,
                tenant_uid=principal.tenant,
                now=now,
                ttl=self.config.session_ttl,
                token_row=principal.token_row,
            )

        opened = await self.context.write(sign_in)
        if opened is None:
            await self._refused_sign_in(request, key, refused)
            return self.render(
                request,
                "login.html",
                401,
                session=None,
                error="That token is unknown or revoked. Create one with `outbox tokens create`.",
            )
        response = self.secure(RedirectResponse("/console/", 303))
        self._cookie(response, request, CONSOLE_COOKIE, opened[0])
        return response

    async def logout(self, request: Request, session: WebSession) -> Response:
        portal = session.kind == "portal"
        name = PORTAL_COOKIE if portal else CONSOLE_COOKIE
        cookie = request.cookies.get(name, "")
        await self.context.write(lambda c: close_session(c, cookie))
        if portal:
            response = self.render(
                request, "portal/expired.html", message="Signed out. Ask for a new link to return."
            )
        else:
            response = self.secure(RedirectResponse("/console/login", 303))
        response.delete_cookie(name, path="/portal" if portal else "/console")
        return response

    async def brand_css(self, request: Request) -> Response:
        css = f":root {{ --brand: {self.config.brand_color}; }}\n"
        return self.secure(Response(css, media_type="text/css"))

    # -- overview -------------------------------------------------------------------------

    async def _overview(self, session: WebSession) -> scoped.Overview:
        now = self.context.clock.now()
        config = self.context.config
        return await self.context.read(
            lambda c: scoped.overview(
                c,
                session.tenant_uid,
                now=now,
                window=config.stats_window,
                thresholds=config.thresholds,
            )
        )

    async def overview(self, request: Request, session: WebSession) -> Response:
        stats = await self._overview(session)
        return self.render(request, "overview.html", session=session, stats=stats)

    async def overview_panel(self, request: Request, session: WebSession) -> Response:
        stats = await self._overview(session)
        return self.render(request, "_overview_panel.html", session=session, stats=stats)

    async def charts(self, request: Request, session: WebSession) -> Response:
        try:
            rng = charts.chart_range(request.query_params.get("range"))
        except ValueError as exc:
            raise PageError(400, str(exc)) from exc
        now = self.context.clock.now()
        since, until = charts.bounds(rng, now)
        window = {"since": since, "until": until, "bucket_seconds": rng.bucket.total_seconds()}
        tenant = session.tenant_uid
        uid = request.path_params.get("uid")

        def read(conn: Connection) -> list[Any]:
            if uid is not None:
                scoped.require_endpoint(conn, uid, tenant)
                statement, params = queries.ENDPOINT_ATTEMPT_SERIES, {**window, "uid": uid}
            else:
                statement, params = queries.ATTEMPT_SERIES, {**window, "tenant_uid": tenant}
            return list(conn.execute(statement, params).mappings())

        rows = await self.context.read(read)
        data = charts.series(rows, rng, now)
        return self.secure(JSONResponse(data), portal=session.kind == "portal")

    # -- endpoints --------------------------------------------------------------------------

    async def endpoints(self, request: Request, session: WebSession) -> Response:
        tenant = session.tenant_uid

        def read(conn: Connection) -> tuple[list[Any], list[str]]:
            found = scoped.list_endpoints(conn, tenant)
            types = scoped.event_types(conn, tenant) if tenant is not None else []
            return found, types

        stats = await self._overview(session)
        found, types = await self.context.read(read)
        health = {e.uid: e for e in stats.endpoints}
        return self.render(
            request,
            "endpoints.html",
            session=session,
            endpoints=found,
            health=health,
            event_types=types,
            created=None,
        )

    async def add_endpoint(self, request: Request, session: WebSession) -> Response:
        if session.tenant_uid is None:
            raise PageError(400, "add endpoints with `outbox endpoints add` or the admin API")
        tenant = session.tenant_uid
        form = await request.form()
        chosen = [str(v) for v in form.getlist("event_type") if str(v).strip()]
        extra = [p.strip() for p in str(form.get("patterns") or "").split(",") if p.strip()]
        https_only = self.context.config.https_only
        created = await self.context.write(
            lambda c: scoped.add_endpoint(
                c,
                self.context.box,
                tenant,
                actor=session.actor,
                url=str(form.get("url") or "").strip(),
                event_types=[*chosen, *extra],
                description=str(form.get("description") or "").strip(),
                https_only=https_only,
                delivery_mode=str(form.get("delivery_mode") or "push"),
                payload_filter=str(form.get("payload_filter") or "") or None,
                concurrency=str(form.get("concurrency") or "adaptive"),
            )
        )
        return await self._endpoint_page(
            request,
            session,
            created.endpoint.uid,
            secret=created.secret,
            notice="created",
            feed_token=created.feed_token,
        )

    def _uid(self, request: Request) -> str:
        raw = str(request.path_params["uid"])
        if len(raw) > 64 or not raw.isascii() or not raw.replace("_", "").isalnum():
            raise NotFoundError(f"no endpoint {raw}")
        return raw

    async def _endpoint_page(
        self,
        request: Request,
        session: WebSession,
        uid: str,
        *,
        secret: str | None = None,
        notice: str | None = None,
        feed_token: str | None = None,
    ) -> Response:
        tenant = session.tenant_uid

        def read(conn: Connection) -> tuple[dict[str, Any], list[Any], list[str]]:
            page = scoped.endpoint_page(conn, uid, tenant, now=self.context.clock.now())
            recent = scoped.search_deliveries(
                conn,
                delivery_ops.DeliveryFilter(endpoint=uid, limit=20),
                tenant=tenant,
                message_id=None,
            )
            owner = str(page["settings"]["tenant_uid"])
            return page, recent, scoped.event_types(conn, owner)

        page, recent, types = await self.context.read(read)
        stats = await self._overview(session)
        health = next((e for e in stats.endpoints if e.uid == uid), None)
        return self.render(
            request,
            "endpoint.html",
            session=session,
            endpoint=page["endpoint"],
            settings=page["settings"],
            adaptive_default_max=self.context.config.adaptive_default_max,
            auth=page["auth"],
            health=health,
            recent=recent,
            event_types=types,
            secret=secret,
            notice=notice,
            feed_token=feed_token,
        )

    async def endpoint(self, request: Request, session: WebSession) -> Response:
        return await self._endpoint_page(request, session, self._uid(request))

    async def endpoint_action(self, request: Request, session: WebSession) -> Response:
        """Every change to one endpoint: the action is the last part of the path."""
        uid = self._uid(request)
        action = str(request.path_params["action"])
        form: dict[str, str] = request.state.form
        tenant, actor, now = session.tenant_uid, session.actor, self.context.clock.now()
        box, config = self.context.box, self.context.config
        portal_only = {"edit", "delete"}
        if action in portal_only and session.kind != "portal":
            raise PageError(400, f"{action} endpoints with `outbox endpoints` or the admin API")
        if action in ("enable", "disable"):
            await self.context.write(
                lambda c: scoped.set_endpoint_enabled(
                    c,
                    uid,
                    tenant,
                    enabled=action == "enable",
                    actor=actor,
                    reason=form.get("reason"),
                )
            )
            return self._redirect(session, f"/endpoints/{uid}")
        if action == "reveal":
            secret = await self.context.write(
                lambda c: scoped.reveal(c, box, uid, tenant, actor=actor)
            )
            return await self._endpoint_page(request, session, uid, secret=secret)
        if action == "rotate":
            rotated = await self.context.write(
                lambda c: scoped.rotate(
                    c, box, uid, tenant, actor=actor, now=now, grace=config.default_rotation_grace
                )
            )
            return await self._endpoint_page(
                request, session, uid, secret=rotated.secret, notice="rotated"
            )
        if action == "feed-token":
            token = await self.context.write(
                lambda c: scoped.rotate_feed_token(c, uid, tenant, actor=actor)
            )
            return await self._endpoint_page(request, session, uid, feed_token=token)
        if action == "test":
            delivery_id = await self.context.write(
                lambda c: scoped.send_test_event(c, uid, tenant, actor=actor, now=now)
            )
            return self._redirect(session, f"/deliveries/{delivery_id}")
        if action == "edit":
            raw = await request.form()
            chosen = [str(v) for v in raw.getlist("event_type") if str(v).strip()]
            extra = [p.strip() for p in (form.get("patterns") or "").split(",") if p.strip()]

            def edit(c: Connection) -> str | None:
                """One transaction: a refused filter leaves the other fields unchanged too."""
                scoped.update_endpoint(
                    c,
                    uid,
                    tenant,
                    actor=actor,
                    url=(form.get("url") or "").strip() or None,
                    description=form.get("description"),
                    event_types=[*chosen, *extra] or None,
                    https_only=config.https_only,
                )
                return scoped.set_feed_fields(
                    c,
                    uid,
                    tenant,
                    actor=actor,
                    delivery_mode=form.get("delivery_mode"),
                    payload_filter=form.get("payload_filter"),
                )

            first_token = await self.context.write(edit)
            if first_token is not None:
                return await self._endpoint_page(request, session, uid, feed_token=first_token)
            return self._redirect(session, f"/endpoints/{uid}")
        if action == "delete":
            await self.context.write(
                lambda c: scoped.delete_endpoint(
                    c, uid, tenant, actor=actor, reason=form.get("reason")
                )
            )
            return self._redirect(session, "/endpoints")
        raise NotFoundError(f"no action {action}")

    # -- tenants, audit -------------------------------------------------------------------

    async def tenants(
        self, request: Request, session: WebSession, issued: dict[str, str] | None = None
    ) -> Response:
        tenant = session.tenant_uid
        rows = await self.context.read(
            lambda c: list(
                c.execute(
                    queries.SELECT_TENANTS_OVERVIEW, {"tenant_uid": tenant, "limit": 500}
                ).mappings()
            )
        )
        return self.render(request, "tenants.html", session=session, tenants=rows, issued=issued)

    async def portal_link(self, request: Request, session: WebSession) -> Response:
        """Issue a portal link from the tenants page, shown once to the operator."""
        tenant = str(request.path_params["uid"])
        now, ttl = self.context.clock.now(), self.config.link_ttl

        def issue(conn: Connection) -> str:
            scoped.issue_link_checked(conn, tenant, session.tenant_uid)
            return issue_portal_link(conn, tenant, actor=session.actor, now=now, ttl=ttl)

        secret = await self.context.write(issue)
        link = portal_link(secret, self.config.public_url)
        if not self.config.public_url:
            link = f"{request.url.scheme}://{request.url.netloc}{link}"
        return await self.tenants(
            request, session, issued={"tenant": tenant, "link": link, "expires": moment(now + ttl)}
        )

    async def audit(self, request: Request, session: WebSession) -> Response:
        q = request.query_params
        actor = (q.get("actor") or "").strip() or None
        action = (q.get("action") or "").strip() or None
        tenant = session.tenant_uid
        entries = await self.context.read(
            lambda c: scoped.list_audit(c, tenant, actor=actor, action=action, limit=100)
        )
        return self.render(
            request, "audit.html", session=session, entries=entries, actor=actor, action=action
        )

    # -- portal ---------------------------------------------------------------------------

    async def portal_enter(self, request: Request) -> Response:
        """Exchange a single-use link for a session; the link leaves the address bar."""
        now = self.context.clock.now()
        key = f"link:{self._client(request)}"
        wait = self.limiter.take(key, now)
        if wait is not None:
            return self.render(
                request,
                "portal/expired.html",
                429,
                message=f"Too many attempts; try again in {wait:.0f} s.",
            )
        secret = request.query_params.get("link", "")

        def exchange(conn: Connection) -> tuple[str, WebSession] | None:
            tenant = redeem_portal_link(conn, secret, now=now)
            if tenant is None:
                return None
            return open_session(
                conn,
                kind="portal",
                actor=f"portal:{tenant}",
                role="operator",
                tenant_uid=tenant,
                now=now,
                ttl=self.config.portal_session_ttl,
            )

        opened = await self.context.write(exchange)
        if opened is None:
            await self._refused_sign_in(request, key, LINK_REFUSED)
            return self.render(
                request,
                "portal/expired.html",
                401,
                message="This link was already used or has expired. Ask for a new one.",
            )
        response = self.secure(RedirectResponse("/portal/", 303), portal=True)
        self._cookie(response, request, PORTAL_COOKIE, opened[0])
        return response

    async def portal_home(self, request: Request, session: WebSession) -> Response:
        return self._redirect(session, "/endpoints")

    # -- routing --------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        c, p = "console", "portal"
        console = [
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.page(c, self.logout), methods=["POST"]),
            Route("/brand.css", self.brand_css, methods=["GET"]),
            Route("/", self.page(c, self.overview), methods=["GET"]),
            Route("/overview/panel", self.page(c, self.overview_panel), methods=["GET"]),
            Route("/charts.json", self.page(c, self.charts), methods=["GET"]),
            Route("/deliveries", self.page(c, self.deliveries), methods=["GET"]),
            Route("/deliveries/{id}", self.page(c, self.delivery), methods=["GET"]),
            Route("/deliveries/{id}/replay", self.page(c, self.replay, act=True), methods=["POST"]),
            Route(
                "/deliveries/{id}/discard", self.page(c, self.discard, act=True), methods=["POST"]
            ),
            Route(
                "/deliveries/{id}/held/{action}",
                self.page(c, self.settle_held, act=True),
                methods=["POST"],
            ),
            Route("/replays", self.page(c, self.bulk_replay, act=True), methods=["POST"]),
            Route("/endpoints", self.page(c, self.endpoints), methods=["GET"]),
            Route("/endpoints/{uid}", self.page(c, self.endpoint), methods=["GET"]),
            Route("/endpoints/{uid}/charts.json", self.page(c, self.charts), methods=["GET"]),
            Route(
                "/endpoints/{uid}/{action}",
                self.page(c, self.endpoint_action, act=True),
                methods=["POST"],
            ),
            Route("/tenants", self.page(c, self.tenants), methods=["GET"]),
            Route(
                "/tenants/{uid}/portal-link",
                self.page(c, self.portal_link, act=True),
                methods=["POST"],
            ),
            Route("/audit", self.page(c, self.audit), methods=["GET"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        portal = [
            Route("/enter", self.portal_enter, methods=["GET"]),
            Route("/logout", self.page(p, self.logout), methods=["POST"]),
            Route("/brand.css", self.brand_css, methods=["GET"]),
            Route("/", self.page(p, self.portal_home), methods=["GET"]),
            Route("/endpoints", self.page(p, self.endpoints), methods=["GET"]),
            Route("/endpoints", self.page(p, self.add_endpoint, act=True), methods=["POST"]),
            Route("/endpoints/{uid}", self.page(p, self.endpoint), methods=["GET"]),
            Route("/endpoints/{uid}/charts.json", self.page(p, self.charts), methods=["GET"]),
            Route(
                "/endpoints/{uid}/{action}",
                self.page(p, self.endpoint_action, act=True),
                methods=["POST"],
            ),
            Route("/deliveries", self.page(p, self.deliveries), methods=["GET"]),
            Route("/deliveries/{id}", self.page(p, self.delivery), methods=["GET"]),
            Route("/deliveries/{id}/replay", self.page(p, self.replay, act=True), methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="portal-static"),
        ]
        return [Mount("/console", routes=console), Mount("/portal", routes=portal)]
