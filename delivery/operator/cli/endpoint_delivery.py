"""Endpoint limits, health, headers and auth commands: delivery tuning, apart from lifecycle."""

from __future__ import annotations

from typing import Any

import click

from delivery.operator import app
from delivery.operator.cli.common import (
    actor_option,
    database,
    default_actor,
    echo_json,
    friendly_errors,
    json_option,
    print_table,
)
from delivery.operator.validation import text_option
from outbox.clock import SystemClock
from outbox.endpoint_auth import (
    MAX_PEM_BYTES,
    check_client_certificate,
    check_oauth_client,
    get_endpoint_auth,
    set_endpoint_auth,
)
from outbox.headers import get_headers, parse_header_argument, set_headers


@click.command("limits")
@click.argument("endpoint_id")
@click.option("--max-in-flight", type=int, default=None, help="Concurrent deliveries; 0: no limit.")
@click.option(
    "--max-per-second", type=float, default=None, help="Requests per second; 0: no limit."
)
@click.option(
    "--ordered/--unordered",
    default=None,
    help="Deliver events with the same ordering key one at a time, in publish order.",
)
@click.option(
    "--dead-head",
    type=click.Choice(["block", "skip"]),
    default=None,
    help="When a key's oldest delivery dies: block the key until an operator acts, or skip it.",
)
@click.option(
    "--concurrency",
    type=click.Choice(["fixed", "adaptive"]),
    default=None,
    help="adaptive (the default for new endpoints): the in-flight limit follows the "
    "endpoint's latency and 429/503 answers, between 1 and --max-in-flight (unset: "
    "OUTBOX_ADAPTIVE_DEFAULT_MAX); fixed: --max-in-flight alone, or no limit.",
)
@actor_option
@json_option
@friendly_errors
def endpoints_limits(
    endpoint_id: str,
    max_in_flight: int | None,
    max_per_second: float | None,
    ordered: bool | None,
    dead_head: str | None,
    concurrency: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show or change an endpoint's limits and ordering; options not given stay as they are."""
    from delivery.health import EndpointLimits, get_endpoint_limits, set_endpoint_limits

    with database() as (settings, db), db.engine.begin() as conn:
        current = get_endpoint_limits(conn, endpoint_id)
        given = (max_in_flight, max_per_second, ordered, dead_head, concurrency)
        if any(value is not None for value in given):
            current = set_endpoint_limits(
                conn,
                endpoint_id,
                EndpointLimits(
                    max_in_flight=current.max_in_flight
                    if max_in_flight is None
                    else (max_in_flight or None),
                    max_per_second=current.max_per_second
                    if max_per_second is None
                    else (max_per_second or None),
                    ordered=current.ordered if ordered is None else ordered,
                    dead_head=current.dead_head if dead_head is None else dead_head,
                    adaptive=current.adaptive if concurrency is None else concurrency == "adaptive",
                ),
                actor=actor or default_actor(),
            )
    if as_json:
        echo_json({"id": endpoint_id, **current.as_json()})
    else:
        # an adaptive endpoint without a maximum of its own is still bounded: say by what
        ceiling = f"{settings.adaptive_default_max} (default)" if current.adaptive else "-"
        print_table(
            [
                [
                    endpoint_id,
                    current.max_in_flight or ceiling,
                    f"{current.max_per_second:g}" if current.max_per_second else "-",
                    "yes" if current.ordered else "no",
                    current.dead_head,
                    "adaptive" if current.adaptive else "fixed",
                ]
            ],
            ["ID", "MAX IN FLIGHT", "MAX/S", "ORDERED", "DEAD HEAD", "CONCURRENCY"],
        )


@click.command("health")
@json_option
@friendly_errors
def endpoints_health(as_json: bool) -> None:
    """Circuit breaker state, limits and backlog of every endpoint."""
    from delivery.health import endpoint_health_report

    with database() as (settings, db), db.engine.connect() as conn:
        report = endpoint_health_report(conn)
    ceiling = settings.adaptive_default_max
    if as_json:
        echo_json(report)
        return
    rows = []
    for item in report:
        state = item["breaker_state"]
        if state == "open" and item["open_until"]:
            state += f" until {item['open_until']}"
        if not item["enabled"]:
            state = f"disabled ({item['disabled_reason']})"
        in_flight = str(item["in_flight"])
        if item["adaptive"]:
            limit = item["adaptive_limit"] or "-"
            in_flight += f" (adaptive limit {limit} of {item['max_in_flight'] or ceiling})"
        rows.append(
            [
                item["endpoint"],
                state,
                in_flight,
                item["scheduled"],
                item["last_failure"] or "",
            ]
        )
    print_table(rows, ["ID", "BREAKER", "IN FLIGHT", "SCHEDULED", "LAST FAILURE"])


@click.command("headers")
@click.argument("endpoint_id")
@click.option(
    "--set", "to_set", multiple=True, help="'Name: value' to send with every request (repeat)."
)
@click.option("--unset", multiple=True, help="A header name to stop sending (repeat).")
@click.option("--clear", is_flag=True, help="Remove every custom header.")
@actor_option
@json_option
@friendly_errors
def endpoints_headers(
    endpoint_id: str,
    to_set: tuple[str, ...],
    unset: tuple[str, ...],
    clear: bool,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show (names only) or change an endpoint's custom request headers, stored encrypted.

    The signature, body framing, host and hop-by-hop headers cannot be set.
    """
    with database() as (current, db):
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            headers = {} if clear else get_headers(conn, box, endpoint_id)
            for name in unset:
                headers.pop(name.lower(), None)
            for item in to_set:
                name, value = parse_header_argument(item)
                headers[name.lower()] = value
            if to_set or unset or clear:
                names = set_headers(conn, box, endpoint_id, headers, actor=actor or default_actor())
            else:
                names = sorted(headers)
    if as_json:
        echo_json({"id": endpoint_id, "headers": names})
    else:
        click.echo(", ".join(names) if names else "no custom headers")


def _read_secret_file(path: str, what: str) -> bytes:
    """A certificate, key or secret file, read up to the size cap (a huge file is refused
    without reading it all)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise click.BadParameter(f"cannot read the {what} file {path!r}: {exc.strerror}") from exc
    if len(data) > MAX_PEM_BYTES:
        raise click.BadParameter(
            f"the {what} file is over {MAX_PEM_BYTES} bytes; give the PEM file"
        )
    return data


@click.command("set-auth")
@click.argument("endpoint_id")
@click.option("--client-cert", metavar="FILE", help="Client certificate (PEM, leaf first).")
@click.option("--client-key", metavar="FILE", help="Its private key (PEM, unencrypted).")
@click.option("--no-client-cert", is_flag=True, help="Stop presenting a client certificate.")
@click.option("--oauth-token-url", metavar="URL", help="OAuth2 token endpoint.")
@click.option("--oauth-client-id", metavar="ID")
@click.option("--oauth-client-secret-file", metavar="FILE", help="A file holding the secret.")
@click.option("--oauth-scope", metavar="SCOPE", default=None)
@click.option("--no-oauth", is_flag=True, help="Stop sending an OAuth2 bearer token.")
@click.option("--clear", is_flag=True, help="Remove the client certificate and OAuth2 client.")
@click.option("--reason", default=None, help="Why, for the audit log.")
@actor_option
@json_option
@friendly_errors
def endpoints_set_auth(
    endpoint_id: str,
    client_cert: str | None,
    client_key: str | None,
    no_client_cert: bool,
    oauth_token_url: str | None,
    oauth_client_id: str | None,
    oauth_client_secret_file: str | None,
    oauth_scope: str | None,
    no_oauth: bool,
    clear: bool,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Show or set how deliveries authenticate: a client certificate (mutual TLS) and/or
    OAuth2 client credentials (a bearer token). Stored encrypted; only the certificate's
    subject, fingerprint and expiry and the OAuth token URL, client id and scope are shown."""
    changes: dict[str, Any] = {}
    if (client_cert is None) != (client_key is None):
        raise click.UsageError("give --client-cert and --client-key together")
    oauth_given = [oauth_token_url, oauth_client_id, oauth_client_secret_file]
    if any(v is not None for v in oauth_given) and not all(v is not None for v in oauth_given):
        raise click.UsageError(
            "give --oauth-token-url, --oauth-client-id and --oauth-client-secret-file together"
        )
    with database() as (current, db):
        if client_cert is not None and client_key is not None:
            checked, summary = check_client_certificate(
                _read_secret_file(client_cert, "client certificate"),
                _read_secret_file(client_key, "client key"),
                now=SystemClock().now(),
            )
            changes.update(client_certificate=checked, certificate_summary=summary)
        elif no_client_cert or clear:
            changes["client_certificate"] = None
        if oauth_token_url is not None and oauth_client_id is not None:
            assert oauth_client_secret_file is not None
            secret = _read_secret_file(oauth_client_secret_file, "OAuth client secret")
            client, shown = check_oauth_client(
                oauth_token_url,
                oauth_client_id,
                secret.decode("utf-8", "replace").strip(),
                oauth_scope,
                https_only=current.https_only,
            )
            changes.update(oauth=client, oauth_summary=shown)
        elif no_oauth or clear:
            changes["oauth"] = None
        box = app.secret_box(current, db)
        with db.engine.begin() as conn:
            if changes:
                auth = set_endpoint_auth(
                    conn,
                    box,
                    endpoint_id,
                    actor=text_option("--actor", actor) or default_actor(),
                    reason=reason,
                    **changes,
                )
            else:
                auth = get_endpoint_auth(conn, endpoint_id)
    if as_json:
        echo_json(auth.as_json())
        return
    cert = auth.client_certificate
    click.echo(
        "client certificate: "
        + (f"{cert['subject']} (sha256 {cert['fingerprint_sha256']}, until {cert['not_after']})"
           if cert else "none")
    )  # fmt: skip
    oauth = auth.oauth
    click.echo(
        "oauth: "
        + (f"{oauth['client_id']} at {oauth['token_url']} scope {oauth['scope'] or '-'}"
           if oauth else "none")
    )  # fmt: skip
