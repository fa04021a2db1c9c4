"""The admin server assembled in one place: every resource module's `routes`, the OpenAPI
document they make, the console beside them (when the 'console' extra is installed), and
uvicorn around it all.

The database work is the same synchronous code the CLI runs, executed on the service's
async engine through `run_sync`, so the two can never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from delivery.operator.api.audit import routes as audit_routes
from delivery.operator.api.concurrency import routes as concurrency_routes
from delivery.operator.api.contract import routes as contract_routes
from delivery.operator.api.core import Call, Dispatcher, Operation, build_openapi
from delivery.operator.api.deliveries import routes as deliveries_routes
from delivery.operator.api.endpoints import routes as endpoints_routes
from delivery.operator.api.feed import routes as feed_routes
from delivery.operator.api.health import routes as health_routes
from delivery.operator.api.stats import routes as stats_routes
from delivery.operator.api.tenants import routes as tenants_routes
from delivery.operator.api.tokens import routes as tokens_routes
from delivery.operator.context import AdminConfig, OperatorContext
from outbox.clock import Clock
from outbox.crypto import SecretBox

log = logging.getLogger(__name__)


async def openapi_route(call: Call) -> Any:
    return openapi_document()


_DOCUMENT_ROUTES = [Operation("GET", "/openapi.json", None, "This document.", openapi_route)]


def all_routes() -> tuple[Operation, ...]:
    """Every route the admin API serves, in the order the document lists them."""
    return (
        *health_routes,
        *_DOCUMENT_ROUTES,
        *stats_routes,
        *deliveries_routes,
        *endpoints_routes,
        *concurrency_routes,
        *feed_routes,
        *tenants_routes,
        *audit_routes,
        *tokens_routes,
        *contract_routes,
    )


def openapi_document() -> dict[str, Any]:
    """The admin API's OpenAPI 3.1 document (served at /openapi.json)."""
    return build_openapi(all_routes())


def create_app(
    engine: AsyncEngine,
    box: SecretBox,
    *,
    clock: Clock | None = None,
    config: AdminConfig | None = None,
) -> Starlette:
    context = OperatorContext(engine, box, clock=clock, config=config)
    api_routes = Dispatcher(context).routes(all_routes())
    app = Starlette(routes=[*api_routes, *console_routes(context)])
    app.state.context = context
    return app


def console_routes(context: OperatorContext) -> list[BaseRoute]:
    """The console and the portal, or none without the 'console' extra: the API serves
    either way, and says once at start-up what is missing."""
    try:
        import python_multipart  # noqa: F401 - the console's form posts are parsed with it

        from delivery.operator.console.web import Console
    except ModuleNotFoundError as exc:
        if exc.name not in ("jinja2", "python_multipart"):
            raise
        log.warning(
            "the console and portal are off: they need the 'console' extra "
            "(pip install 'webhook-outbox[console]'); the admin API is served without them"
        )
        return []
    return Console(context, context.config.console).routes()


def forwarded_options(trusted_proxies: Sequence[str]) -> dict[str, Any]:
    """uvicorn's proxy options for OUTBOX_TRUSTED_PROXIES, always explicit.

    Left out, uvicorn believes X-Forwarded-For from 127.0.0.1 and ::1 (or whatever
    FORWARDED_ALLOW_IPS says); with no trusted proxy it reads no forwarded header at all.
    """
    trusted = list(trusted_proxies)
    return {"proxy_headers": bool(trusted), "forwarded_allow_ips": trusted}


def _admin_config(app: Starlette) -> AdminConfig:
    context = getattr(app.state, "context", None)
    return context.config if isinstance(context, OperatorContext) else AdminConfig()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the host process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    app: Starlette,
    *,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_started: Callable[[int], None] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve `app` until `stop` is set; `on_started` gets the bound port (port 0 picks one).

    `sock`, already bound, is served instead of binding host:port here: the CLI binds
    it before anything else starts, so a busy port is reported first.

    X-Forwarded-For and X-Forwarded-Proto are honoured only from the app's trusted
    proxies (AdminConfig.trusted_proxies), and then the client is the rightmost address
    that is not itself a trusted proxy. uvicorn would otherwise trust them from any
    loopback peer (its default), letting a local client pick the address it is rate
    limited and audited under.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        **forwarded_options(_admin_config(app).trusted_proxies),
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
    try:
        while not server.started:
            if task.done():
                await task  # surfaces the bind error
                raise OSError(f"the admin API could not listen on {host}:{port}")
            await asyncio.sleep(0.01)
        if on_started is not None:
            bound = server.servers[0].sockets[0].getsockname()[1]
            on_started(int(bound))
        await stop.wait()
    finally:
        server.should_exit = True
        await task
