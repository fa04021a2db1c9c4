"""`outbox tenants`: the application's customers, each owning endpoints.

Routing rule: an event published for tenant T reaches T's matching endpoints, plus the
endpoints created with `--all-tenants`; nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from delivery.operator.cli.common import (
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    print_table,
    reason_option,
)
from outbox import tenants as ops
from outbox.clock import SystemClock
from outbox.errors import TenantError
from outbox.wording import plural


def _metadata(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        loaded = json.loads(value)
    except json.JSONDecodeError as exc:
        raise TenantError(
            f'--metadata must be a JSON object, e.g. \'{{"plan": "pro"}}\' ({exc})'
        ) from exc
    if not isinstance(loaded, dict):
        raise TenantError('--metadata must be a JSON object, e.g. \'{"plan": "pro"}\'')
    return loaded


def _rows(items: Sequence[ops.Tenant]) -> list[list[object]]:
    return [
        [
            t.uid,
            t.name or "-",
            "enabled" if t.enabled else f"disabled ({t.disabled_reason})",
            t.endpoints,
            t.max_in_flight or "-",
            f"{t.max_per_second:g}" if t.max_per_second else "-",
        ]
        for t in items
    ]


_HEADERS = ["TENANT", "NAME", "STATE", "ENDPOINTS", "MAX IN FLIGHT", "MAX/S"]


def _show(item: ops.Tenant, as_json: bool) -> None:
    if as_json:
        echo_json(item.as_json())
    else:
        print_table(_rows([item]), _HEADERS)


@click.group()
def tenants() -> None:
    """Tenants: your customers, each owning endpoints and receiving only its own events."""


@tenants.command("add")
@click.argument("tenant_id")
@click.option("--name", default="", help="A display name.")
@click.option("--metadata", default=None, help="A JSON object kept with the tenant.")
@click.option(
    "--max-in-flight", type=int, default=None, help="Concurrent deliveries, all its endpoints."
)
@click.option(
    "--max-per-second", type=float, default=None, help="Requests per second, all its endpoints."
)
@actor_option
@json_option
@friendly_errors
def tenants_add(
    tenant_id: str,
    name: str,
    metadata: str | None,
    max_in_flight: int | None,
    max_per_second: float | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Create a tenant; TENANT_ID is your own customer id (up to 255 characters)."""
    with database() as (_, db), db.engine.begin() as conn:
        item = ops.add_tenant(
            conn,
            tenant_id,
            actor=actor or default_actor(),
            name=name,
            metadata=_metadata(metadata),
            max_in_flight=max_in_flight,
            max_per_second=max_per_second,
        )
    _show(item, as_json)


@tenants.command("list")
@click.option("--after", default=None, help="Next page: tenant ids after this one.")
@click.option("--limit", default=100, show_default=True, help="Page size (1..1000).")
@click.option(
    "--enabled/--disabled", "enabled", default=None, help="Only enabled or disabled ones."
)
@json_option
@friendly_errors
def tenants_list(after: str | None, limit: int, enabled: bool | None, as_json: bool) -> None:
    """List tenants in id order."""
    with database() as (_, db), db.engine.connect() as conn:
        items = ops.list_tenants(conn, after=after, enabled=enabled, limit=limit)
    next_after = items[-1].uid if len(items) == limit else None
    if as_json:
        echo_json({"items": [t.as_json() for t in items], "next_after": next_after})
        return
    print_table(_rows(items), _HEADERS)
    if next_after:
        click.echo(f"more: add --after {next_after}")


@tenants.command("show")
@click.argument("tenant_id")
@json_option
@friendly_errors
def tenants_show(tenant_id: str, as_json: bool) -> None:
    """A tenant with its endpoints, events, deliveries by state and active tokens."""
    with database() as (_, db), db.engine.connect() as conn:
        detail = ops.show_tenant(conn, tenant_id)
    if as_json:
        echo_json(detail.as_json())
        return
    t = detail.tenant
    click.echo(f"tenant:     {t.uid}" + (f" ({t.name})" if t.name else ""))
    click.echo(
        "state:      "
        + ("enabled" if t.enabled else f"disabled since {t.disabled_at} ({t.disabled_reason})")
    )
    click.echo(f"metadata:   {json.dumps(t.metadata)}")
    click.echo(
        f"caps:       max in flight {t.max_in_flight or '-'}, "
        f"max/s {f'{t.max_per_second:g}' if t.max_per_second else '-'}"
    )
    click.echo(f"endpoints:  {t.endpoints} ({detail.all_tenants_endpoints} all-tenants)")
    click.echo(f"events:     {detail.events} ({detail.unrelayed_events} not relayed yet)")
    click.echo("deliveries: " + "  ".join(f"{k} {v}" for k, v in detail.deliveries.items()))
    if detail.other_pending:
        click.echo(f"            {detail.other_pending} more pending on all-tenants endpoints")
    click.echo(f"tokens:     {detail.tokens} active")


def _cap(value: float | None) -> Any:
    """An update's cap: not given (unchanged), 0 (no limit) or a value."""
    if value is None:
        return ops.UNSET
    return value or None


@tenants.command("update")
@click.argument("tenant_id")
@click.option("--name", default=None)
@click.option("--metadata", default=None, help="A JSON object (replaces the stored one).")
@click.option("--max-in-flight", type=int, default=None, help="Concurrent deliveries; 0: no limit.")
@click.option(
    "--max-per-second", type=float, default=None, help="Requests per second; 0: no limit."
)
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def tenants_update(
    tenant_id: str,
    name: str | None,
    metadata: str | None,
    max_in_flight: int | None,
    max_per_second: float | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Change a tenant's name, metadata or caps; options not given stay as they are."""
    with database() as (_, db), db.engine.begin() as conn:
        item = ops.update_tenant(
            conn,
            tenant_id,
            actor=actor or default_actor(),
            now=SystemClock().now(),
            name=name,
            metadata=_metadata(metadata),
            max_in_flight=_cap(max_in_flight),
            max_per_second=_cap(max_per_second),
            reason=reason,
        )
    _show(item, as_json)


@tenants.command("disable")
@click.argument("tenant_id")
@click.option("--reason", required=True, help="Why, for operators and the audit log.")
@actor_option
@json_option
@friendly_errors
def tenants_disable(tenant_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Hold a tenant's deliveries (nothing is dropped) until it is enabled again."""
    with database() as (_, db), db.engine.begin() as conn:
        item = ops.set_tenant_enabled(
            conn,
            tenant_id,
            enabled=False,
            reason=reason,
            actor=actor or default_actor(),
            now=SystemClock().now(),
        )
    _show(item, as_json)


@tenants.command("enable")
@click.argument("tenant_id")
@actor_option
@json_option
@friendly_errors
def tenants_enable(tenant_id: str, actor: str | None, as_json: bool) -> None:
    """Enable a tenant; its held deliveries resume."""
    with database() as (_, db), db.engine.begin() as conn:
        item = ops.set_tenant_enabled(
            conn, tenant_id, enabled=True, actor=actor or default_actor(), now=SystemClock().now()
        )
    _show(item, as_json)


@tenants.command("delete")
@click.argument("tenant_id")
@reason_option
@click.option("--force", is_flag=True, help="Delete even with pending deliveries or events.")
@actor_option
@json_option
@friendly_errors
def tenants_delete(
    tenant_id: str, reason: str, force: bool, actor: str | None, as_json: bool
) -> None:
    """Delete a tenant, its endpoints, events and history, and revoke its tokens."""
    with database() as (_, db), db.engine.begin() as conn:
        result = ops.delete_tenant(
            conn,
            tenant_id,
            actor=actor or default_actor(),
            reason=reason,
            now=SystemClock().now(),
            force=force,
        )
    if as_json:
        echo_json({"deleted": tenant_id, **result})
    else:
        click.echo(
            f"deleted {tenant_id}: {plural(result['endpoints'], 'endpoint')}, "
            f"{plural(result['events'], 'event')}, "
            f"{plural(result['deliveries'], 'delivery', 'deliveries')}, "
            f"{plural(result['attempts'], 'attempt')}; "
            f"{plural(len(result['revoked_tokens']), 'token')} revoked"
        )
