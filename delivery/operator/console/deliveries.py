"""Delivery pages and actions (list, detail, replay, discard, settle held), mixed into Console."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from delivery.operator.console import scoped
from delivery.operator.console.base import (
    ConsoleBase,
    PageError,
)
from delivery.operator.console.sessions import (
    WebSession,
)
from outbox import deliveries as delivery_ops
from outbox.deliveries import HELD_ACTIONS
from outbox.errors import NotFoundError, OperationError, PublishError
from outbox.owners import check_owner
from outbox.publish import validate_subject
from outbox.schema import DELIVERY_STATES


class DeliveryPages(ConsoleBase):
    """The deliveries half of the console and the portal, and the redirects its actions share."""

    # -- deliveries -----------------------------------------------------------------------

    def _filter(self, request: Request) -> delivery_ops.DeliveryFilter:
        q = request.query_params

        def text(name: str) -> str | None:
            value = (q.get(name) or "").strip()
            return value or None

        def when(name: str) -> dt.datetime | None:
            value = text(name)
            if value is None:
                return None
            try:
                parsed = dt.datetime.fromisoformat(value)
            except ValueError as exc:
                raise PageError(400, f"{name}: use a date and time like 2026-11-30T10:00") from exc
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)

        before = text("before")
        if before is not None and not (before.isascii() and before.isdigit() and len(before) < 19):
            raise PageError(400, "before must be a delivery id")
        state = text("state")
        return delivery_ops.DeliveryFilter(
            states=(state,) if state else (),
            endpoint=text("endpoint"),
            event_type=text("event_type"),
            error=text("error"),
            subject=self._subject(text("subject")),
            since=when("since"),
            until=when("until"),
            before_id=int(before) if before else None,
            limit=50,
            owner=self._owner(text("owner")),
        )

    @staticmethod
    def _subject(value: str | None) -> str | None:
        """A subject filter, held to publish()'s rules (a NUL would fail in the database)."""
        try:
            return None if value is None else validate_subject(value)
        except PublishError as exc:
            raise PageError(400, str(exc)) from exc

    @staticmethod
    def _owner(value: str | None) -> str | None:
        """An owner filter is a team name (outbox.owners) or a 400 that says so."""
        if value is None:
            return None
        try:
            return check_owner(value)
        except OperationError as exc:
            raise PageError(400, str(exc)) from exc

    def _tenant_of(self, request: Request, session: WebSession) -> str | None:
        """The session's tenant; an unscoped operator may filter on one instead."""
        if session.tenant_uid is not None:
            return session.tenant_uid
        chosen = (request.query_params.get("tenant") or "").strip()
        return chosen or None

    async def deliveries(self, request: Request, session: WebSession) -> Response:
        flt = self._filter(request)
        tenant = self._tenant_of(request, session)
        message_id = (request.query_params.get("message_id") or "").strip() or None
        items = await self.context.read(
            lambda c: scoped.search_deliveries(c, flt, tenant=tenant, message_id=message_id)
        )
        query = {k: v for k, v in request.query_params.items() if v and k != "before"}
        next_page = (
            "?" + urlencode({**query, "before": items[-1].id}) if len(items) == flt.limit else None
        )
        return self.render(
            request,
            "deliveries.html",
            session=session,
            items=items,
            query=query,
            next_page=next_page,
            states=DELIVERY_STATES,
            # A bulk replay takes the filter's fields (the tenant among them), not a message id.
            bulk=session.kind == "console" and "message_id" not in query,
        )

    def _delivery_id(self, request: Request) -> int:
        raw = request.path_params["id"]
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
            raise NotFoundError(f"no delivery {raw}")
        return int(raw)

    async def delivery(self, request: Request, session: WebSession) -> Response:
        delivery_id = self._delivery_id(request)
        tenant = session.tenant_uid
        detail, superseded = await self.context.read(
            lambda c: scoped.delivery_page(c, delivery_id, tenant)
        )
        return self.render(
            request,
            "delivery.html",
            session=session,
            detail=detail,
            notice=None,
            superseded_by=superseded,
        )

    def _root(self, session: WebSession) -> str:
        return "/portal" if session.kind == "portal" else "/console"

    def _redirect(self, session: WebSession, path: str) -> Response:
        return self.secure(
            RedirectResponse(self._root(session) + path, 303), portal=session.kind == "portal"
        )

    async def replay(self, request: Request, session: WebSession) -> Response:
        delivery_id = self._delivery_id(request)
        form: dict[str, str] = request.state.form
        now = self.context.clock.now()
        result = await self.context.write(
            lambda c: scoped.replay(
                c,
                delivery_id,
                session.tenant_uid,
                actor=session.actor,
                reason=form.get("reason"),
                now=now,
                force=form.get("force") == "yes",
            )
        )
        # Straight to the new delivery, so the operator watches it succeed or fail.
        target = result.replayed[0][1] if result.replayed else delivery_id
        return self._redirect(session, f"/deliveries/{target}")

    async def discard(self, request: Request, session: WebSession) -> Response:
        delivery_id = self._delivery_id(request)
        form: dict[str, str] = request.state.form
        now = self.context.clock.now()
        await self.context.write(
            lambda c: scoped.discard(
                c,
                delivery_id,
                session.tenant_uid,
                actor=session.actor,
                reason=form.get("reason"),
                now=now,
            )
        )
        return self._redirect(session, f"/deliveries/{delivery_id}")

    async def settle_held(self, request: Request, session: WebSession) -> Response:
        """Confirm a held delivery delivered, or send it again (discard is `discard`)."""
        delivery_id = self._delivery_id(request)
        action = request.path_params["action"]
        if action not in HELD_ACTIONS:
            raise NotFoundError(f"no action {action}")
        form: dict[str, str] = request.state.form
        now = self.context.clock.now()
        await self.context.write(
            lambda c: scoped.resolve_held(
                c,
                delivery_id,
                session.tenant_uid,
                action=action,
                actor=session.actor,
                reason=form.get("reason"),
                now=now,
            )
        )
        return self._redirect(session, f"/deliveries/{delivery_id}")

    async def bulk_replay(self, request: Request, session: WebSession) -> Response:
        """Step one (no `confirm`): a dry run shown to the operator. Step two: the replay."""
        form: dict[str, str] = request.state.form
        flt = delivery_ops.DeliveryFilter(
            states=(form.get("state") or "dead",),
            endpoint=form.get("endpoint") or None,
            event_type=form.get("event_type") or None,
            error=form.get("error") or None,
            subject=self._subject(form.get("subject") or None),
            # A scoped session's tenant, whatever the form says; else the operator's filter.
            tenant=session.tenant_uid or form.get("tenant") or None,
        )
        now = self.context.clock.now()
        confirm = form.get("confirm") == "yes"
        result = await self.context.write(
            lambda c: delivery_ops.bulk_replay(
                c,
                flt,
                actor=session.actor,
                reason=form.get("reason"),
                now=now,
                dry_run=not confirm,
                force=form.get("force") == "yes",
                rate_per_minute=self.context.config.replay_rate_per_minute,
            )
        )
        return self.render(
            request,
            "bulk_replay.html",
            session=session,
            result=result.as_json(),
            form=form,
            confirmed=confirm,
        )
