"""Every index on `deliveries` and the statement that needs it (issue 26's index diet).

Each index costs every write that is not a HOT update: the relay's insert and the
worker's two updates (claim, outcome) each add an entry to every index whose
predicate the new row version matches. So each one must be earned: this test lists
them all with the statement that uses it, EXPLAINs that statement (or its shape, named
in the comment) on a migrated database and checks the plan reads that index. A new
index, or a dropped one, fails the first test until it is added here with its user.

The plans are taken with sequential scans discouraged: the test tables are nearly
empty, and the question is which index the statement can use, not whether a scan of
ten rows would be cheaper.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from delivery import queries as delivery_queries
from outbox.db import sqlalchemy_url
from outbox.sql import deliveries as delivery_sql

# index -> (what uses it, the statement EXPLAINed, its parameters). A statement given as
# a string is the shape of the named one (its full text needs a whole claim's context).
USES: dict[str, tuple[str, object, dict[str, object]]] = {
    "pk_deliveries": (
        "RECORD_OUTCOMES and every write back by id",
        "UPDATE deliveries SET updated_at = now() WHERE id = ANY(CAST(:ids AS bigint[]))",
        {"ids": [1, 2]},
    ),
    "uq_deliveries_first_per_endpoint": (
        "RELAY_BATCH's insert: its ON CONFLICT arbiter (one first delivery per event, endpoint)",
        "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts,"
        " next_attempt_at) VALUES (1, 1, 1, 8, now())"
        " ON CONFLICT (event_id, endpoint_id) WHERE replay_of IS NULL DO NOTHING",
        {},
    ),
    "ix_deliveries_due_ranked": (
        "QUICK_CLAIM_GATES / LOCK_CLAIM_GATES: what is due, in claim order, across endpoints",
        "SELECT id FROM deliveries WHERE state = 'scheduled' AND next_attempt_at <= now()"
        " ORDER BY priority DESC, next_attempt_at, id LIMIT 100",
        {},
    ),
    "ix_deliveries_due_per_endpoint_ranked": (
        "CLAIM_DUE_DELIVERIES: one endpoint's due rows in claim order",
        "SELECT id FROM deliveries WHERE endpoint_id = 1 AND state = 'scheduled'"
        " AND next_attempt_at <= now() ORDER BY priority DESC, next_attempt_at, id LIMIT 50",
        {},
    ),
    "ix_deliveries_leases": (
        "RESCUE_EXPIRED_LEASES (the reaper)",
        delivery_queries.RESCUE_EXPIRED_LEASES,
        {"now": "2026-12-01T00:00:00Z", "limit": 100, "max_rescues": 5},
    ),
    "ix_deliveries_endpoint_state": (
        "COUNT_IN_FLIGHT (endpoint limits); per-endpoint counts; ON DELETE CASCADE from endpoints",
        delivery_queries.COUNT_IN_FLIGHT,
        {"ids": [1, 2]},
    ),
    "ix_deliveries_tenant_id_in_flight": (
        "COUNT_TENANT_IN_FLIGHT (tenant caps)",
        delivery_queries.COUNT_TENANT_IN_FLIGHT,
        {"ids": [1, 2]},
    ),
    "ix_deliveries_replay_of": (
        "SELECT_LATEST_REPLAYS, SELECT_REPLAYS; ON DELETE SET NULL of replay_of",
        delivery_sql.SELECT_LATEST_REPLAYS,
        {"ids": [1, 2]},
    ),
    "uq_deliveries_one_pending_replay": (
        "INSERT_REPLAYS: its ON CONFLICT arbiter (one pending replay per original)",
        "INSERT INTO deliveries (event_id, endpoint_id, tenant_id, max_attempts,"
        " next_attempt_at, replay_of) VALUES (1, 1, 1, 8, now(), 1)"
        " ON CONFLICT (replay_of) WHERE replay_of IS NOT NULL"
        " AND state IN ('scheduled', 'in_flight') DO NOTHING",
        {},
    ),
    "ix_deliveries_tenant_id_id": (
        "SEARCH_DELIVERIES scoped to a tenant, newest first; ON DELETE of a tenant",
        "SELECT id FROM deliveries WHERE tenant_id = 1 ORDER BY id DESC LIMIT 50",
        {},
    ),
    "ix_deliveries_ordering": (
        "CLAIM_DUE_DELIVERIES' head-of-key check for endpoints with per-key ordering",
        "SELECT 1 FROM deliveries p WHERE p.endpoint_id = 1 AND p.ordering_key = 'k'"
        " AND p.event_id < 10",
        {},
    ),
    "ix_deliveries_event_id_endpoint_id": (
        "PRUNE_DELIVERIES' groups and PRUNE_EVENTS' check (replays included);"
        " ON DELETE CASCADE from outbox_events",
        "SELECT 1 FROM deliveries d WHERE d.event_id = 1",
        {},
    ),
    "ix_deliveries_completed_at": (
        "PRUNE_DELIVERIES' seed: finished deliveries, oldest first",
        "SELECT event_id FROM deliveries WHERE state IN ('succeeded', 'dead', 'discarded')"
        " AND completed_at < now() ORDER BY completed_at LIMIT 100",
        {},
    ),
    "ix_deliveries_held": (
        "the held lists and counts (CLI, API, console, metrics)",
        "SELECT count(*) FROM deliveries WHERE state = 'held' AND tenant_id = 1",
        {},
    ),
}


@pytest.fixture(scope="module")
def migrated(server_url: str, clones: Any) -> Iterator[Engine]:
    """One migrated database for the module: the statements are only EXPLAINed."""
    name = clones.take()
    engine = create_engine(
        make_url(sqlalchemy_url(server_url)).set(database=name).render_as_string(False)
    )
    try:
        yield engine
    finally:
        engine.dispose()
        clones.give_back(name)


def test_every_index_on_deliveries_is_listed_with_its_user(migrated: Engine) -> None:
    with migrated.connect() as conn:
        found = set(
            conn.execute(
                text("SELECT indexname FROM pg_indexes WHERE tablename = 'deliveries'")
            ).scalars()
        )
    assert found == set(USES), (
        "an index on deliveries was added or dropped: list it in USES with the statement "
        f"that needs it (missing: {sorted(found - set(USES))}, gone: {sorted(set(USES) - found)})"
    )


@pytest.mark.parametrize("index", sorted(USES))
def test_the_statement_that_needs_the_index_reads_it(migrated: Engine, index: str) -> None:
    _, statement, params = USES[index]
    sql = statement if isinstance(statement, str) else statement.text  # type: ignore[attr-defined]
    with migrated.connect() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(conn.execute(text("EXPLAIN " + sql), params).scalars())
        conn.rollback()
    assert index in plan, plan
