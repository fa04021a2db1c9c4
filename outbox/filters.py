"""Payload filters: an endpoint receives only the events whose payload matches its SQL/JSON
path predicate (`$.amount >= 100 && $.currency == "EUR"`).

The relay evaluates the filter in SQL (outbox/sql/relay.py, `outbox_payload_matches` of
migration 0025), so no user code ever runs in our process; an endpoint without a filter
costs nothing more. A filter is checked here when it is set, by PostgreSQL's own parser,
and refused when it could hurt the relay:

- over MAX_FILTER_LENGTH characters (which also bounds how deeply it can nest);
- a variable (`$name`): the relay passes none, and a missing variable raises even in
  silent mode;
- `like_regex`: PostgreSQL's regex engine has patterns whose cost grows with the input
  (`(.*){1,200}b` took 1.35 s on one 5,000-character string, per event and endpoint),
  and a statement_timeout cancel would fail the whole relay batch, every time; `starts
  with`, `==` and `exists` cover what partners filter on;
- not a predicate (`$.amount` alone): it is true or false only by accident.

A filter that cannot be evaluated on one event (a string where a number was compared)
skips that event for that endpoint and is recorded in `filter_skips`, never stopping
the relay.
"""

from __future__ import annotations

import re

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from outbox.errors import EndpointError
from outbox.sql import feeds as queries

MAX_FILTER_LENGTH = 1000
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_PREDICATE_REQUIRED = "22038"  # singleton_sql_json_item_required


def _postgres_message(exc: DBAPIError) -> str:
    """The first line of PostgreSQL's message, without the echoed statement."""
    primary = getattr(getattr(exc.orig, "diag", None), "message_primary", None)
    return str(primary or exc.orig)


def validate_filter(conn: Connection, value: str | None) -> str | None:
    """The filter to store (None: no filter), or EndpointError saying what is wrong."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > MAX_FILTER_LENGTH:
        raise EndpointError(
            f"the payload filter is {len(value)} characters; at most {MAX_FILTER_LENGTH} "
            "are allowed: filter on fewer fields, or subscribe by event type instead"
        )
    if "\x00" in value:
        raise EndpointError("the payload filter contains a NUL character: remove it")
    try:
        with conn.begin_nested():
            normalized = str(conn.execute(queries.NORMALIZE_FILTER, {"filter": value}).scalar())
    except DBAPIError as exc:
        raise EndpointError(
            f"the payload filter {value[:80]!r} is not a valid SQL/JSON path: "
            f'{_postgres_message(exc)} (example: $.amount >= 100 && $.currency == "EUR")'
        ) from exc
    outside_strings = _STRING.sub('"s"', normalized)
    if re.search(r'\$"', outside_strings):
        raise EndpointError(
            "the payload filter uses a variable ($name); filters take none: "
            'compare with a literal instead ($.currency == "EUR")'
        )
    if "like_regex" in outside_strings:
        raise EndpointError(
            "like_regex is not allowed in payload filters (a regular expression can make "
            "every event slow to relay); use `starts with`, == or exists(...) instead"
        )
    try:
        with conn.begin_nested():
            conn.execute(queries.PROBE_FILTER, {"filter": value})
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == _PREDICATE_REQUIRED:
            raise EndpointError(
                f"the payload filter {value[:80]!r} is a path, not a predicate: compare it "
                "($.paid == true, $.amount > 0) or test it (exists($.refund))"
            ) from exc
        # Anything else it raised on {} it will skip (and count) at relay time.
    return value
