"""`outbox portal`: single-use links into a tenant's self-service portal."""

from __future__ import annotations

import click

from delivery.operator.cli.common import (
    actor_option,
    admin_base_url,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    parse_duration,
)
from outbox.clock import SystemClock


@click.group()
def portal() -> None:
    """The tenant portal (/portal): links that open it for one tenant."""


@portal.command("link")
@click.argument("tenant")
@click.option("--ttl", default="15m", show_default=True, help="How long the link works: 90s, 15m.")
@actor_option
@json_option
@friendly_errors
def portal_link_command(tenant: str, ttl: str, actor: str | None, as_json: bool) -> None:
    """Print a single-use link that opens TENANT's portal (audited).

    Hand it to the tenant's people; opening it starts a portal session confined to that
    tenant, and the link stops working. The link starts with OUTBOX_PUBLIC_URL, or when
    that is unset with the address `outbox serve` listens on (OUTBOX_ADMIN_HOST/PORT).
    """
    from delivery.operator.console.sessions import issue_portal_link, portal_link

    lifetime = parse_duration(ttl)
    now = SystemClock().now()
    with database() as (current, db), db.engine.begin() as conn:
        secret = issue_portal_link(
            conn, tenant, actor=actor or default_actor(), now=now, ttl=lifetime
        )
    base = current.public_url or admin_base_url(current.admin_host, current.admin_port)
    link = portal_link(secret, base)
    expires = (now + lifetime).isoformat()
    if as_json:
        echo_json({"tenant": tenant, "link": link, "expires_at": expires})
    else:
        click.echo(link)
        click.echo(f"single use, until {expires}", err=True)
        if current.public_url is None:
            click.echo(
                "(OUTBOX_PUBLIC_URL is unset, so this is the address `outbox serve` listens "
                "on; set it to the address your tenants reach)",
                err=True,
            )
