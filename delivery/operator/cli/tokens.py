"""`outbox tokens`: bearer tokens for the admin HTTP API."""

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
    print_table,
)
from outbox.clock import SystemClock
from outbox.tokens import ROLES, create_token, list_tokens, revoke_token


@click.group()
def tokens() -> None:
    """Bearer tokens for the admin HTTP API (roles: viewer, operator)."""


@tokens.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(list(ROLES)), required=True)
@click.option(
    "--tenant",
    default=None,
    help="Confine the token to this tenant: it sees and acts on that tenant's objects only.",
)
@click.option(
    "--expires-in",
    default=None,
    help="Stop working after this long (90s, 15m, 24h, 30d); default: never.",
)
@actor_option
@json_option
@friendly_errors
def tokens_create(
    name: str,
    role: str,
    tenant: str | None,
    expires_in: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Create a token; it is printed once and stored only as a hash."""
    lifetime = None if expires_in is None else parse_duration(expires_in)
    with database() as (_, db), db.engine.begin() as conn:
        info, secret = create_token(
            conn,
            name=name,
            role=role,
            actor=actor or default_actor(),
            tenant=tenant,
            expires_in=lifetime,
            now=SystemClock().now(),
        )
    if as_json:
        echo_json({**info.as_json(), "token": secret})
    else:
        click.echo(f"token: {secret}")
        scope = f", confined to tenant {info.tenant}" if info.tenant else ", every tenant"
        if info.expires_at is not None:
            scope += f", expires {info.expires_at.isoformat(timespec='seconds')}"
        click.echo(f"role {info.role}{scope}; store it now, it is not shown again")


@tokens.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@json_option
@friendly_errors
def tokens_list(include_revoked: bool, as_json: bool) -> None:
    """List tokens (never their secrets)."""
    now = SystemClock().now()
    with database() as (_, db), db.engine.connect() as conn:
        items = list_tokens(conn, include_revoked=include_revoked)
    if as_json:
        echo_json([item.as_json() for item in items])
        return
    print_table(
        [
            [
                t.name,
                t.role,
                t.tenant or "(all)",
                t.token_id,
                t.created_by,
                t.last_used_at.isoformat(timespec="seconds") if t.last_used_at else "never",
                "revoked" if t.revoked_at else ("expired" if t.expired(now) else "active"),
            ]
            for t in items
        ],
        ["NAME", "ROLE", "TENANT", "TOKEN ID", "CREATED BY", "LAST USED", "STATE"],
    )


@tokens.command("revoke")
@click.argument("name")
@actor_option
@json_option
@friendly_errors
def tokens_revoke(name: str, actor: str | None, as_json: bool) -> None:
    """Revoke a token by name or token id; it and its console sessions stop working at once."""
    with database() as (_, db), db.engine.begin() as conn:
        token_id = revoke_token(conn, name, actor=actor or default_actor(), now=SystemClock().now())
    if as_json:
        echo_json({"revoked": token_id})
    else:
        click.echo(f"revoked {token_id}")
