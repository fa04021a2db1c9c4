"""The admin HTTP API: the operator's CLI as JSON, behind bearer tokens, plus /metrics.

- `core`: the small framework (Call, Operation, the dispatcher, errors, the OpenAPI
  document generated from the validation models);
- one module of routes per resource, each with its `routes = [...]`: `deliveries`,
  `endpoints`, `concurrency` (an endpoint's in-flight limit, fixed or adaptive),
  `tenants` (and portal links), `tokens`, `stats` (and /metrics), `audit`, `contract`
  (event types, rejected events, test events), `health`;
- `server`: the app assembled from them and the console, and uvicorn around it.
"""

from delivery.operator.api.server import (
    all_routes,
    create_app,
    forwarded_options,
    openapi_document,
    serve,
)
from delivery.operator.context import AdminConfig

__all__ = [
    "AdminConfig",
    "all_routes",
    "create_app",
    "forwarded_options",
    "openapi_document",
    "serve",
]
