"""`outbox portal`: single-use links into a tenant's self-service portal."""

from __future__ import annotations

import click

from delivery.operator.cli.common import (
    actor_option,
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
    tenant, and the link stops working. With OUTBOX_PUBLIC_URL set the link is a full URL,
    otherwise a path on the admin server.
    """
    from delivery.operator.console.sessions import issue_portal_link, portal_link

    lifetime = parse_duration(ttl)
    now = SystemClock().now()
    with database() as (current, db), db.engine.begin() as conn:
        secret = issue_portal_link(
            conn, tenant, actor=actor or default_actor(), now=now, ttl=lifetime
        )
    link = portal_link(secret, current.public_url)
    expires = (now + lifetime).isoformat()
    if as_json:
        echo_json({"tenant": tenant, "link": link, "expires_at": expires})
    else:
        click.echo(link)
        click.echo(f"single use, until {expires}", err=True)
