"""The admin API's small framework: what a handler gets (`Call`), how a route is declared
(`Operation`), the dispatcher that authenticates, runs and renders every call, and the
OpenAPI document built from the same declarations.

A route names its inputs once, as pydantic models of delivery.operator.validation (its
query string and its JSON body) plus its path parameters; the document is generated from
those models (`model_json_schema()`), and a handler can read no query parameter or body
field its route did not declare (`Call` refuses with a programming error, a 500), so the
document cannot miss a parameter the handler accepts.

Roles: a viewer reads; an operator also replays, discards and changes endpoints. A token
may be confined to one tenant: then every route reads and acts on that tenant's rows
only, enforced in the queries (the `scope` every outbox call takes), and another
tenant's object answers 404 exactly like one that does not exist. Unscoped tokens can
narrow reads with `?tenant=`. A refused call (401 without a valid token, 403 with too
weak a role or for what a tenant-scoped token may not do) is written to the audit log
like any other action, with the request id.

Errors: refused input (a validation error, an outbox refusal) is a 400 that says why;
anything else a handler raises is our bug, a 500 whose traceback is logged under the
request id the answer carries (body and `x-request-id`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import CoreSchema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from delivery.operator.context import OperatorContext
from delivery.operator.refusals import RATE_LIMITED, UnauthenticatedLimiter, client_address
from delivery.operator.validation import (
    DeliveryRef,
    EndpointRef,
    InputError,
    flag_value,
    integer_value,
    nul_in,
    parse,
    time_value,
)
from outbox.errors import NotFoundError, OutboxError
from outbox.tenants import require_tenant
from outbox.tokens import Principal, Role, TokenRefusedError, authenticate, role_allows

log = logging.getLogger("delivery.operator.api")
M = TypeVar("M", bound=BaseModel)

REQUEST_ID_HEADER = "x-request-id"
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ApiError(Exception):
    """An HTTP error answer; raised inside handlers, rendered once by the dispatcher."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UndeclaredInputError(RuntimeError):
    """A handler read an input its route does not declare: our bug (500), never a 400."""


@dataclass(frozen=True, slots=True)
class Param:
    """A path parameter (query parameters and bodies are pydantic models)."""

    name: str
    description: str
    kind: str = "string"  # OpenAPI type


TENANT_FILTER = "Only this tenant's (a tenant-scoped token is always confined to its own)."

Handler = Callable[["Call"], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    role: Role | None  # None: no token needed
    summary: str
    handler: Handler
    path_params: tuple[Param, ...] = ()
    query: type[BaseModel] | None = None  # the query string, as a validation model
    body: type[BaseModel] | None = None  # the JSON body, as a validation model
    tenant_filter: bool = False  # takes ?tenant= (resolved against the database)

    def query_names(self) -> set[str]:
        """The query parameters the route takes (what its document lists)."""
        names = input_names(self.query) if self.query is not None else set()
        return names | {"tenant"} if self.tenant_filter else names


def input_names(model: type[BaseModel]) -> set[str]:
    """The names a model reads from the input: its fields, by alias where they have one."""
    return {field.alias or name for name, field in model.model_fields.items()}


class _DeclaredBody(dict[str, Any]):
    """A parsed body whose fields may be read only if the route's body model names them."""

    def __init__(self, data: dict[str, Any], model: type[BaseModel], op: Operation) -> None:
        super().__init__(data)
        self._known = input_names(model)
        self._route = f"{op.method} {op.path}"

    def _check(self, key: str) -> None:
        if key not in self._known:
            raise UndeclaredInputError(f"{self._route} reads body field {key!r}; declare it")

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)


@dataclass(slots=True)
class Call:
    """What a handler gets: the request, who is asking, its route and the shared pieces."""

    request: Request
    request_id: str
    principal: Principal | None
    api: OperatorContext
    op: Operation
    _body: Any = None

    @property
    def actor(self) -> str:
        return self.principal.actor if self.principal else "anonymous"

    @property
    def scope(self) -> str | None:
        """The tenant a scoped token is confined to; None for an unscoped caller."""
        return self.principal.tenant if self.principal else None

    async def tenant(self, requested: Any = None, *, from_query: bool = True) -> str | None:
        """The tenant to narrow to: the scope, or the `tenant` asked for (which must exist).

        `requested` defaults to the `tenant` query parameter. A scoped caller asking for
        another tenant gets the not-found an unknown one gets.
        """
        if requested is None and from_query:
            requested = self.query("tenant")
        if requested is None:
            return self.scope
        scope = self.scope
        return await self.api.read(lambda c: require_tenant(c, requested, scope=scope))

    def unscoped_only(self, what: str) -> None:
        if self.scope is not None:
            raise ApiError(403, f"a tenant-scoped token cannot {what}; use an unscoped token")

    def query(self, name: str) -> str | None:
        if name not in self.op.query_names():
            raise UndeclaredInputError(
                f"{self.op.method} {self.op.path} reads query parameter {name!r}; declare it"
            )
        value = self.request.query_params.get(name)
        if value and "\x00" in value:
            # PostgreSQL cannot hold a NUL anywhere: refused for every route, not only
            # those whose parameters go through a model.
            raise InputError(f"{name}: contains a NUL: remove it")
        return value if value not in (None, "") else None

    def query_as(self, model: type[M]) -> M:
        """The query string as `model`, which must be the route's declared query model.

        Parameters the model does not know are left alone: `tenant`, for one, is
        resolved against the database by `tenant()`.
        """
        if model is not self.op.query:
            raise UndeclaredInputError(f"{self.op.path} reads its query as {model.__name__}")
        data = {}
        for name in model.model_fields:
            value = self.query(name)
            if value is not None:
                data[name] = value
        return parse(model, data)

    def query_int(self, name: str, default: int | None = None) -> int | None:
        """One integer query parameter, as strict as the models (no `1.5`, no full-width)."""
        value = self.query(name)
        return default if value is None else integer_value(name, value)

    def query_flag(self, name: str) -> bool | None:
        """true/false, 1/0, yes/no, or None when absent; anything else is refused."""
        value = self.query(name)
        return None if value is None else flag_value(name, value)

    def query_time(self, name: str) -> dt.datetime | None:
        value = self.query(name)
        return None if value is None else time_value(name, value)

    def path_int(self, name: str) -> int:
        return integer_value(name, self.request.path_params[name], ge=1)

    def path_id(self) -> int:
        return parse(DeliveryRef, {"id": self.request.path_params["id"]}).id

    def path_uid(self) -> str:
        return parse(EndpointRef, {"uid": self.request.path_params["uid"]}).uid

    async def body(self) -> dict[str, Any]:
        """The JSON body as a dict; only the fields of the route's body model can be read."""
        model = self.op.body
        if model is None:
            raise UndeclaredInputError(f"{self.op.method} {self.op.path} declares no body")
        if self._body is None:
            raw = await read_capped_body(self.request, self.api.config.max_body_bytes)
            try:
                self._body = json.loads(raw) if raw.strip() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
            except RecursionError as exc:
                raise ApiError(400, "the request body nests too deeply") from exc
            if not isinstance(self._body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            where = nul_in(self._body)
            if where is not None:
                raise InputError(f"{where}: contains a NUL: remove it")
        return _DeclaredBody(self._body, model, self.op)

    async def body_as(self, model: type[M]) -> M:
        """The body as `model`, which must be the route's declared body model."""
        if model is not self.op.body:
            raise UndeclaredInputError(f"{self.op.path} reads its body as {model.__name__}")
        return parse(model, dict(await self.body()))


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to be over `limit` (the rest is never read).

    A Content-Length over the limit is refused before a byte of the body is read; a
    chunked body is refused at the first chunk that passes it.
    """
    too_big = ApiError(
        413,
        f"the request body is over {limit} bytes (OUTBOX_ADMIN_MAX_BODY_BYTES); "
        "send less, e.g. replay by filter instead of listing ids",
    )
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


# -- dispatch ---------------------------------------------------------------------------


class Dispatcher:
    """Turns declared operations into Starlette routes: token, role, handler, answer."""

    def __init__(self, context: OperatorContext) -> None:
        self.context = context
        self.limiter = UnauthenticatedLimiter(context.config.unauthenticated_per_minute)

    async def authorize(self, call: Call, needed: Role) -> Response | None:
        """None when allowed; otherwise the 401/403/429 answer (see delivery.operator.refusals).

        401 and 403 are audited, aggregated per client and reason; a client without a
        valid token past its rate limit gets 429 and costs no write at all.
        """
        header = call.request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        now = self.context.clock.now()
        principal = None
        if scheme.lower() == "bearer" and presented:
            try:
                principal = await self.context.write(lambda c: authenticate(c, presented, now=now))
            except TokenRefusedError as exc:
                await self._refuse(call, 401, str(exc), "anonymous")
                return JSONResponse(
                    {"error": str(exc)}, 401, headers={"www-authenticate": "Bearer"}
                )
        if principal is None:
            wait = self.limiter.take(client_address(call.request) or "unknown", now)
            if wait is not None:
                return JSONResponse(
                    {"error": f"{RATE_LIMITED}; try again in {wait:.0f}s with a valid token"},
                    429,
                    headers={"retry-after": f"{wait:.0f}"},
                )
            why = "no bearer token" if not header else "invalid or revoked bearer token"
            await self._refuse(call, 401, why, "anonymous")
            return JSONResponse(
                {"error": f"{why}: send 'Authorization: Bearer obx_...' "
                 "(create one with `outbox tokens create`)"},
                401,
                headers={"www-authenticate": "Bearer"},
            )  # fmt: skip
        call.principal = principal
        if not role_allows(principal.role, needed):
            why = f"role {principal.role} cannot do this; it needs {needed}"
            await self._refuse(call, 403, why, principal.actor, principal.tenant)
            return JSONResponse({"error": why}, 403)
        return None

    async def _refuse(
        self, call: Call, status: int, why: str, actor: str, tenant: str | None = None
    ) -> None:
        client = client_address(call.request)
        # The client's 429s so far ride along with its next written 401.
        limited = self.limiter.limited_since_written(client or "unknown") if status == 401 else 0
        await self.context.record_refused(
            call.request,
            request_id=call.request_id,
            status=status,
            why=why,
            actor=actor,
            tenant=tenant,
            limited=limited,
        )

    def endpoint(self, op: Operation) -> Callable[[Request], Awaitable[Response]]:
        async def dispatch(request: Request) -> Response:
            incoming = request.headers.get(REQUEST_ID_HEADER, "")
            request_id = incoming if _SAFE_REQUEST_ID.match(incoming) else uuid.uuid4().hex
            call = Call(
                request=request, request_id=request_id, principal=None, api=self.context, op=op
            )
            response = await self._answer(call, op)
            response.headers[REQUEST_ID_HEADER] = request_id
            return response

        return dispatch

    async def _answer(self, call: Call, op: Operation) -> Response:
        needed = op.role
        if op.path == "/metrics" and self.context.config.metrics_public:
            needed = None
        if needed is not None:
            refused = await self.authorize(call, needed)
            if refused is not None:
                return refused
        try:
            result = await op.handler(call)
        except ApiError as exc:
            if exc.status == 403:  # a scoped token beyond its scope: refused like a role
                await self._refuse(call, 403, exc.message, call.actor, call.scope)
            return JSONResponse({"error": exc.message}, exc.status)
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, 404)
        except OutboxError as exc:
            # Refused input or a refused change (the transaction rolled back): say why.
            return JSONResponse({"error": str(exc) or type(exc).__name__}, 400)
        except Exception:
            # Our bug, not the caller's: the traceback goes to the log under the request
            # id, the caller gets the id to quote and nothing of the internals.
            log.exception(
                "admin API %s %s failed (request id %s)", op.method, op.path, call.request_id
            )
            return internal_error(call.request_id)
        if isinstance(result, Response):
            return result
        return JSONResponse(json.loads(json.dumps(result, default=str)))

    def routes(self, operations: Iterable[Operation]) -> list[Route]:
        grouped: dict[str, list[Operation]] = {}
        for op in operations:
            grouped.setdefault(op.path, []).append(op)
        routes = []
        for path, ops_for_path in grouped.items():
            by_method = {op.method: self.endpoint(op) for op in ops_for_path}
            routes.append(Route(path, _by_method(by_method), methods=list(by_method)))
        return routes


def internal_error(request_id: str) -> JSONResponse:
    """The 500 answer: the request id to quote, nothing of the internals."""
    return JSONResponse(
        {
            "error": f"internal error; the log holds the details under request id {request_id}",
            "request_id": request_id,
        },
        500,
        headers={REQUEST_ID_HEADER: request_id},
    )


def _by_method(
    handlers: dict[str, Callable[[Request], Awaitable[Response]]],
) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await handlers[request.method](request)

    return route


# -- the OpenAPI document ---------------------------------------------------------------


class _WithoutFieldTitles(GenerateJsonSchema):
    """pydantic's schemas, less the "Max Count" titles it derives from field names."""

    def field_title_should_be_set(self, schema: CoreSchema) -> bool:
        return False


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """The model's JSON schema; nested models go to components/schemas, referenced there."""
    schema = model.model_json_schema(
        ref_template="#/components/schemas/{model}", schema_generator=_WithoutFieldTitles
    )
    components.update(_standard_bounds(schema.pop("$defs", {})))
    bounded: dict[str, Any] = _standard_bounds(schema)
    return bounded


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(schema: Any) -> Any:
    """JSON Schema's names for the bounds pydantic leaves as `ge`/`le` on a number that
    goes through a BeforeValidator first (delivery.operator.validation's strict integers)."""
    if isinstance(schema, list):
        return [_standard_bounds(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    numeric = schema.get("type") in ("integer", "number")
    return {
        (_BOUNDS[key] if numeric and key in _BOUNDS else key): _standard_bounds(value)
        for key, value in schema.items()
    }


def _query_parameters(op: Operation, components: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if op.query is not None:
        schema = _schema(op.query, components)
        required = set(schema.get("required", ()))
        for name, prop in schema.get("properties", {}).items():
            prop = dict(prop)
            prop.pop("title", None)
            description = prop.pop("description", name)
            param: dict[str, Any] = {
                "name": name,
                "in": "query",
                "required": name in required,
                "description": description,
                "schema": prop,
            }
            if prop.get("type") == "array":  # state=dead,discarded
                param.update(style="form", explode=False)
            found.append(param)
    if op.tenant_filter:
        found.append(
            {
                "name": "tenant",
                "in": "query",
                "required": False,
                "description": TENANT_FILTER,
                "schema": {"type": "string"},
            }
        )
    return found


def _operation_spec(op: Operation, components: dict[str, Any]) -> dict[str, Any]:
    path_params = [
        {
            "name": p.name,
            "in": "path",
            "required": True,
            "description": p.description,
            "schema": {"type": p.kind},
        }
        for p in op.path_params
    ]
    spec: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{op.method.lower()}_{op.handler.__name__}",
        "parameters": [*path_params, *_query_parameters(op, components)],
        "responses": {
            "200": {"description": "OK"},
            "400": {"description": "Refused: the error message says why"},
            "500": {"description": "Our bug: the body and x-request-id give the request id"},
        },
    }
    if op.role is not None:
        spec["security"] = [{"bearer": []}]
        spec["x-required-role"] = op.role
        spec["responses"]["401"] = {"description": "No valid bearer token"}
        spec["responses"]["403"] = {"description": f"Needs the {op.role} role"}
        spec["responses"]["429"] = {
            "description": "Too many calls without a valid token; see Retry-After"
        }
    if op.body is not None:
        schema = _schema(op.body, components)
        spec["responses"]["413"] = {"description": "Body over OUTBOX_ADMIN_MAX_BODY_BYTES"}
        spec["requestBody"] = {
            "required": bool(schema.get("required")),
            "content": {"application/json": {"schema": schema}},
        }
    return spec


def build_openapi(operations: Iterable[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`, from their declarations and models."""
    paths: dict[str, dict[str, Any]] = {}
    components: dict[str, Any] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation_spec(op, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "webhook-outbox admin API",
            "version": "1",
            "description": "Viewer tokens read; operator tokens also act. A token confined "
            "to a tenant sees and acts on that tenant's objects only; any other tenant's "
            "object answers 404. Create tokens with "
            "`outbox tokens create NAME --role viewer|operator [--tenant T]`.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
        },
        "paths": paths,
    }
