"""`outbox keys`: the keys that encrypt endpoint secrets at rest."""

from __future__ import annotations

import click

from delivery.operator.cli.common import (
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
)
from outbox.crypto import generate_key


@click.group()
def keys() -> None:
    """Keys that encrypt endpoint secrets at rest."""


@keys.command("generate")
def keys_generate() -> None:
    """Print a new OUTBOX_SECRET_KEYS entry."""
    click.echo(generate_key())


@keys.command("rotate")
@actor_option
@json_option
@friendly_errors
def keys_rotate(actor: str | None, as_json: bool) -> None:
    """Re-encrypt every endpoint secret with the first key of OUTBOX_SECRET_KEYS.

    Put the new key first and keep the old one after it until this has run.
    """
    from delivery.operator import app
    from outbox.endpoints import reencrypt_secrets

    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            changed = reencrypt_secrets(conn, box, actor=actor or default_actor())
    if as_json:
        echo_json({"endpoints": changed, "key_id": box.current_key_id})
    else:
        click.echo(f"re-encrypted {changed} endpoint secrets with key {box.current_key_id!r}")
