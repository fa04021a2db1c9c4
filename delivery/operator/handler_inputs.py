"""The inputs of the admin API routes whose handlers read and check them themselves.

The tenant, token and catalogue rules (outbox.tenants, outbox.tokens, outbox.catalogue)
say what is wrong with a value; these models only declare the inputs, so the admin API's
document lists each one and a handler can read nothing else. The inputs that one shared
validation layer refuses before any handler runs are in delivery.operator.validation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ReadByHandler(BaseModel):
    """The inputs of a route whose handler reads and checks them itself (the tenant,
    token and catalogue rules say what is wrong): declared here so the admin API's
    document lists them and the handler can read nothing else (delivery.operator.api)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class TenantListQuery(ReadByHandler):
    after: str | None = Field(None, description="Paging: only ids after this (pass next_after).")
    enabled: bool | None = Field(None, description="true or false.")
    limit: int = Field(100, description="Page size, 1..1000 (default 100).")


class TenantDelete(ReadByHandler):
    reason: str = Field(description="Why (required).")
    force: bool = Field(False, description="Delete pending ones too.")


class TenantCreate(ReadByHandler):
    id: str = Field(description="The tenant id (your customer id).")
    name: str | None = None
    metadata: dict[str, Any] | None = None
    max_in_flight: int | None = None
    max_per_second: float | None = None


class TenantUpdate(ReadByHandler):
    reason: str | None = Field(None, description="Why; goes in the audit log.")
    name: str | None = None
    metadata: dict[str, Any] | None = None
    max_in_flight: int | None = Field(None, description="0 or null: no limit.")
    max_per_second: float | None = Field(None, description="0 or null: no limit.")


class TenantAction(ReadByHandler):
    reason: str | None = Field(None, description="Why; goes in the audit log.")


class TenantDisable(TenantAction):
    """Disabling takes a reason (its audit row says why the deliveries are held)."""

    reason: str = Field(description="Why; goes in the audit log (required).")


class PortalLinkCreate(ReadByHandler):
    ttl_seconds: int = Field(
        900, description="How long the link works (default 900, at most 7 days)."
    )


class TokenCreate(ReadByHandler):
    name: str
    role: Literal["viewer", "operator"]
    tenant: str | None = None
    expires_in_seconds: float | None = Field(None, gt=0)


class EventTypeCreate(ReadByHandler):
    name: str
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema (Draft 2020-12).")
    description: str | None = None
    example: dict[str, Any] | None = None


class EventTypeUpdate(ReadByHandler):
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="A JSON Schema (Draft 2020-12)."
    )
    description: str | None = None
    example: dict[str, Any] | None = None
    status: Literal["active", "deprecated", "archived"] | None = None


class ContractExportQuery(ReadByHandler):
    title: str | None = Field(None, description="info.title")
    version: str | None = Field(None, description="info.version")
    operational: bool | None = Field(None, description="false: leave out the operational events.")


class RejectedQuery(ReadByHandler):
    limit: int = Field(100, description="At most this many (default 100).")


class RequeueRejected(ReadByHandler):
    reason: str
    skip_validation: bool = False


class SendTestEvent(ReadByHandler):
    event_type: str | None = None
    wait_seconds: float | None = Field(None, description="0 to 30 (default 10).")
