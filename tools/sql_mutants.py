"""The hand-written SQL mutants of tools/mutation.py: each removes or weakens one guard.

mutmut sees an SQL statement as one string and can only replace all of it, which proves
nothing about a guard. Each mutant here names the file, the text it changes, what it
becomes and the tests that must fail; `within` pins it to one statement when the same
condition is written in several.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SqlMutant:
    name: str
    file: str
    old: str  # replaced once; a mutant whose text is absent is reported not applicable
    new: str
    tests: tuple[str, ...]
    # The statement the change belongs to (e.g. "SELECT_DELIVERY = text("): `old` is
    # replaced at its first occurrence after this text and before the next statement,
    # for conditions written the same way in several statements.
    within: str = ""


def apply_mutant(source: str, mutant: SqlMutant) -> str | None:
    """`source` with the mutant applied, or None if its text is not where it should be."""
    start = 0
    if mutant.within:
        start = source.find(mutant.within)
        if start < 0:
            return None
        start += len(mutant.within)
    at = source.find(mutant.old, start)
    if at < 0 or (mutant.within and "= text(" in source[start:at]):
        return None
    return source[:at] + mutant.new + source[at + len(mutant.old) :]


_LEASES = (
    "tests/delivery/test_fencing.py",
    "tests/delivery/test_rules.py",
    "-k",
    "not aiohttp and (lease or rescue or reaper or shutdown or late or release or outcome)",
)
_REPLAY = ("tests/outbox/test_deliveries.py",)
_HANDOFF = ("tests/delivery/test_handoff.py",)
_ROUTING = (
    "tests/outbox/test_relay.py",
    "tests/outbox/test_tenant_routing.py",
    "tests/outbox/test_publish.py",
)
Q = "delivery/queries.py"
C = "delivery/claim_queries.py"  # the claim and its gates
# outbox/'s SQL, by subject (before, all of it was in outbox/queries.py: see _sql_mutants).
RELAY_SQL = "outbox/sql/relay.py"
DELIVERIES_SQL = "outbox/sql/deliveries.py"
OLD_OQ = "outbox/queries.py"


def _defined_in(statement: str) -> str:
    """The outbox/sql module that defines `statement`, so a scope mutant names no path."""
    for path in sorted((ROOT / "outbox" / "sql").glob("*.py")):
        if f"\n{statement} = " in path.read_text():
            return str(path.relative_to(ROOT))
    return OLD_OQ  # defined nowhere: the mutant reports "not applicable"


# Operator-side tenant scope: each mutant drops one statement's scope condition.
_SCOPE = (
    "tests/outbox/test_tenant_scope.py",
    "tests/operator/test_tenant_api.py",
    "-k",
    "not unscoped and not deleted_tenant and not bad_tenant",
)
_TEXT_SCOPE = "(CAST(:scope AS text) IS NULL OR {} = :scope)"


def _S(column: str) -> str:
    """outbox/sql's source text of a scope condition on `column`."""
    return '{in_scope("' + column + '")}'


def _AND_S(column: str) -> str:
    return " AND " + _S(column)


SQL_MUTANTS = [
    # claim
    SqlMutant(
        "claim: no claim number bump",
        C,
        "updated_at = :now, claims = d.claims + 1",
        "updated_at = :now, claims = d.claims",
        _LEASES,
    ),
    SqlMutant(
        "claim: final re-check of state dropped",
        C,
        "WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id\n"
        "      AND d.state = 'scheduled'",
        "WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id",
        (
            "tests/delivery/test_claim_contention.py",
            "tests/delivery/test_worker.py",
            "-k",
            "not aiohttp",
        ),
    ),
    # outcome
    SqlMutant(
        "outcome: state guard dropped",
        Q,
        "WHERE d.id = o.id AND d.state = 'in_flight'",
        "WHERE d.id = o.id",
        _LEASES,
    ),
    SqlMutant(
        "outcome: claim guard dropped",
        Q,
        "AND d.claims = o.claim",
        "",
        _LEASES,
    ),
    SqlMutant(
        "outcome: worker guard dropped",
        Q,
        "AND d.locked_by = :worker_id\n        RETURNING d.id",
        "\n        RETURNING d.id",
        _LEASES,
    ),
    SqlMutant(
        "outcome: attempt numbered by attempts, not by claim",
        Q,
        "SELECT o.id, o.claim, o.started_at",
        "SELECT o.id, o.attempts, o.started_at",
        _LEASES,
    ),
    SqlMutant(
        "outcome: repeated write not absorbed",
        Q,
        "ON CONFLICT (delivery_id, attempt_number) DO NOTHING",
        "",
        _LEASES,
    ),
    # release
    SqlMutant(
        "release: claim guard dropped",
        Q,
        "AND d.claims = c.claim",
        "",
        _LEASES,
    ),
    SqlMutant(
        "release: state guard dropped",
        Q,
        "WHERE d.id = c.id AND d.state = 'in_flight'",
        "WHERE d.id = c.id",
        _LEASES,
    ),
    SqlMutant(  # main before issue 15: the guard was the worker name only
        "release (old): worker guard dropped",
        Q,
        "AND state = 'in_flight' AND locked_by = :worker_id",
        "AND state = 'in_flight'",
        _LEASES,
    ),
    # rescue
    SqlMutant(
        "rescue: lease expiry test dropped",
        Q,
        "WHERE state = 'in_flight' AND lease_expires_at < :now",
        "WHERE state = 'in_flight'",
        _LEASES,
    ),
    SqlMutant(
        "rescue: lease expiry off by one (<=)",
        Q,
        "WHERE state = 'in_flight' AND lease_expires_at < :now",
        "WHERE state = 'in_flight' AND lease_expires_at <= :now",
        _LEASES,
    ),
    SqlMutant(
        "rescue: SKIP LOCKED dropped (waits for the writer)",
        Q,
        "ORDER BY lease_expires_at\n        LIMIT :limit\n        FOR UPDATE SKIP LOCKED",
        "ORDER BY lease_expires_at\n        LIMIT :limit\n        FOR UPDATE",
        _LEASES,
    ),
    SqlMutant(
        "rescue: claim re-check dropped",
        Q,
        "AND d.state = 'in_flight' AND d.claims = expired.claims",
        "AND d.state = 'in_flight'",
        _LEASES,
    ),
    SqlMutant(
        "rescue: poison limit off by one",
        Q,
        "SET state = CASE WHEN d.rescues + 1 >= :max_rescues",
        "SET state = CASE WHEN d.rescues + 1 > :max_rescues",
        _LEASES,
    ),
    # replay and discard
    SqlMutant(
        "replay: state re-check dropped",
        DELIVERIES_SQL,
        "WHERE d.state = ANY(CAST(:allowed AS text[]))",
        "WHERE true",
        _REPLAY,
    ),
    SqlMutant(
        "replay: originals not locked (a concurrent replay does not wait)",
        DELIVERIES_SQL,
        "ORDER BY id FOR UPDATE",
        "ORDER BY id",
        ("tests/outbox/test_replay_once.py", "-k", "concurrent"),
    ),
    SqlMutant(
        "discard: in-flight rows not left alone",
        DELIVERIES_SQL,
        "AND state IN ('scheduled', 'dead', 'held')",
        "AND state IN ('scheduled', 'dead', 'held', 'in_flight')",
        _REPLAY,
    ),
    SqlMutant(
        "discard: terminal rows discarded again",
        DELIVERIES_SQL,
        "AND state IN ('scheduled', 'dead', 'held')",
        "",
        _REPLAY,
    ),
    # relay routing
    SqlMutant(
        "routing: disabled endpoints get deliveries",
        RELAY_SQL,
        "WHERE x.id = r.endpoint_id AND x.enabled\n",
        "WHERE x.id = r.endpoint_id\n",
        _ROUTING,
    ),
    SqlMutant(
        "routing: tenant ignored",
        RELAY_SQL,
        "WHERE pattern = c.pattern AND tenant_id = b.tenant_id",
        "WHERE pattern = c.pattern",
        _ROUTING,
    ),
    SqlMutant(
        "routing: all-tenants endpoints ignored",
        RELAY_SQL,
        "            UNION ALL\n"
        "            SELECT endpoint_id FROM endpoint_subscriptions\n"
        "            WHERE pattern = c.pattern AND tenant_id IS NULL",
        "",
        _ROUTING,
    ),
    SqlMutant(
        "routing: no 'prefix.*' candidates",
        RELAY_SQL,
        "WHERE substr(b.event_type, i, 1) = '.'",
        "WHERE substr(b.event_type, i, 1) = '_'",
        _ROUTING,
    ),
    SqlMutant(
        "routing: '*' is not a candidate",
        RELAY_SQL,
        "SELECT '*' AS pattern\n    WHERE b.event_type NOT IN",
        "SELECT '*' AS pattern\n    WHERE false AND b.event_type NOT IN",
        _ROUTING,
    ),
    SqlMutant(
        "handoff: ordered endpoints handed off",
        RELAY_SQL,
        "{HEALTH_GATED} OR h.ordered)",
        "{HEALTH_GATED})",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        # the gate condition is one fragment, shared with the claim and its quick path
        "handoff: open breaker ignored",
        RELAY_SQL,
        "(h.breaker_state <> 'closed' OR ",
        "(false OR ",
        _HANDOFF,
        within="HEALTH_GATED = ",
    ),
    SqlMutant(
        "handoff: capped tenants handed off",
        RELAY_SQL,
        "AND t.max_in_flight IS NULL AND t.max_per_second IS NULL",
        "",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: disabled tenants handed off",
        RELAY_SQL,
        "WHERE t.id = e.tenant_id AND t.enabled",
        "WHERE t.id = e.tenant_id",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: the worker's slots left per endpoint ignored",
        RELAY_SQL,
        "COALESCE(s.slots, :endpoint_slots)",
        ":endpoint_slots",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: more than the reserved slots",
        RELAY_SQL,
        ":handoff_limit AS handed",
        ":handoff_limit + 1 AS handed",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: no lease on a handed-off delivery",
        RELAY_SQL,
        "CAST(:lease_expires_at AS timestamptz) END",
        "NULL END",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "routing: events marked relayed twice (relayed_at filter dropped)",
        RELAY_SQL,
        "WHERE relayed_at IS NULL AND NOT validate_pending\n    ORDER BY id",
        "WHERE NOT validate_pending\n    ORDER BY id",
        _ROUTING,
    ),
    SqlMutant(
        "rules: least specific max-attempts rule wins",
        RELAY_SQL,
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern) DESC",
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern)",
        ("tests/delivery/test_documented_rules.py", "-k", "not aiohttp"),
    ),
    SqlMutant(
        "rules: exact type not preferred over an equally long prefix",
        RELAY_SQL,
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern) DESC",
        "ORDER BY length(r.pattern) DESC",
        ("tests/delivery/test_documented_rules.py", "-k", "not aiohttp"),
    ),
    # a disabled tenant's deliveries wait (the claim only visits enabled tenants' heads)
    SqlMutant(
        "claim: disabled tenant not held",
        C,
        "WHERE x.id = e.tenant_id AND x.enabled LIMIT 1",
        "WHERE x.id = e.tenant_id LIMIT 1",
        ("tests/delivery/test_tenant_claims.py", "-k", "disabled_tenant"),
        within='_DUE_HEADS = """',  # both the gates and the folded claim read it
    ),
    # the quick path (QUICK_CLAIM_GATES) answers only when its batch is plain
    SqlMutant(
        "claim ranking: a disabled tenant taken as plain",
        Q,
        "SELECT y.enabled AND y.max_in_flight IS NULL",
        "SELECT y.max_in_flight IS NULL",
        ("tests/delivery/test_claim_rank.py", "-k", "falls_back"),
        within='_CLAIMABLE = """',
    ),
    SqlMutant(
        "claim ranking: set-aside tenants' first turns not checked",
        Q,
        "        SELECT f.* FROM firsts f WHERE f.set_aside",
        "        SELECT f.* FROM firsts f WHERE false",
        ("tests/delivery/test_claim_rank.py", "-k", "falls_back"),
    ),
    *(
        SqlMutant(
            f"scope: {name}", _defined_in(statement), old, new, _SCOPE, within=f"{statement} = "
        )
        for name, statement, old, new in [
            # endpoints
            ("endpoint list", "SELECT_ENDPOINTS", _S("e.tenant_id"), "true"),
            ("endpoint by id", "SELECT_ENDPOINT_BY_UID", _AND_S("e.tenant_id"), ""),
            ("endpoint enable/disable", "SET_ENDPOINT_ENABLED", _AND_S("tenant_id"), ""),
            ("endpoint update", "UPDATE_ENDPOINT", _AND_S("tenant_id"), ""),
            ("endpoint secret rotation", "ROTATE_ENDPOINT_SECRET", _AND_S("tenant_id"), ""),
            ("endpoint delivery counts", "COUNT_ENDPOINT_DELIVERIES", _AND_S("e.tenant_id"), ""),
            ("endpoint delete", "DELETE_ENDPOINT", _AND_S("tenant_id"), ""),
            (
                "endpoint secret reveal",
                "SELECT_ENDPOINT_SECRET",
                "AND {in_scope('tenant_id')}",
                "",
            ),
            # deliveries: list, lookup by id, replay, bulk replay, discard
            ("delivery search and count", "_DELIVERY_FILTER", _S("d.tenant_id"), "true"),
            ("delivery by id", "SELECT_DELIVERY", _AND_S("d.tenant_id"), ""),
            ("delivery states (discard check)", "SELECT_DELIVERY_STATES", _AND_S("tenant_id"), ""),
            ("replay lock", "LOCK_DELIVERIES_FOR_REPLAY", _AND_S("tenant_id"), ""),
            ("replay insert", "INSERT_REPLAYS", _AND_S("d.tenant_id"), ""),
            ("discard write", "DISCARD_DELIVERIES", _AND_S("tenant_id"), ""),
            # audit
            ("audit list", "SELECT_AUDIT", _TEXT_SCOPE.format("tenant_uid"), "true"),
            # stats and metrics
            ("stats counts by state", "STATS_COUNTS_BY_STATE", "{in_scope('tenant_id')}", "true"),
            ("stats oldest due", "STATS_OLDEST_DUE", _AND_S("d.tenant_id"), ""),
            ("stats relay lag", "STATS_RELAY_LAG", _AND_S("tenant_id"), ""),
            ("stats and metrics attempts", "_SCOPED_ATTEMPTS", _AND_S("sd.tenant_id"), ""),
            (
                "stats window succeeded",
                "STATS_WINDOW_RATES",
                "state = 'succeeded' AND completed_at >= :since AND completed_at <= :now\n"
                "          " + _AND_S("tenant_id"),
                "state = 'succeeded' AND completed_at >= :since AND completed_at <= :now\n",
            ),
            (
                "stats window dead",
                "STATS_WINDOW_RATES",
                "state = 'dead' AND completed_at >= :since AND completed_at <= :now\n"
                "          " + _AND_S("tenant_id"),
                "state = 'dead' AND completed_at >= :since AND completed_at <= :now\n",
            ),
            (
                "stats window dead in the previous window",
                "STATS_WINDOW_RATES",
                "completed_at >= :previous AND completed_at < :since\n"
                "          " + _AND_S("tenant_id"),
                "completed_at >= :previous AND completed_at < :since\n",
            ),
            (
                "stats window published",
                "STATS_WINDOW_RATES",
                "created_at <= :now" + _AND_S("tenant_id"),
                "created_at <= :now",
            ),
            ("stats endpoints: attempts", "STATS_ENDPOINTS", _AND_S("d.tenant_id"), ""),
            (
                "stats endpoints: backlog",
                "STATS_ENDPOINTS",
                "\n         " + _AND_S("tenant_id"),
                "",
            ),
            (
                "stats endpoints: endpoints",
                "STATS_ENDPOINTS",
                "WHERE " + _S("e.tenant_id") + "\n    ORDER BY e.id",
                "WHERE true\n    ORDER BY e.id",
            ),
            ("stats top errors", "STATS_TOP_ERRORS", _AND_S("d.tenant_id"), ""),
            ("metrics events", "METRICS_EVENTS", _S("tenant_id"), "true"),
            ("metrics pruned totals", "SELECT_PRUNED_TOTALS", _S("tenant_id"), "true"),
            # tenants, tokens, rejected events
            ("tenant list", "SELECT_TENANTS", _TEXT_SCOPE.format("t.uid"), "true"),
            ("tenant by id", "SELECT_TENANT", _TEXT_SCOPE.format("t.uid"), "true"),
            ("token list", "SELECT_TOKENS", _TEXT_SCOPE.format("tenant_uid"), "true"),
            (
                "token revoke lookup",
                "SELECT_TOKENS_TO_REVOKE",
                _TEXT_SCOPE.format("tenant_uid"),
                "true",
            ),
            ("rejected events list", "SELECT_REJECTED_EVENTS", _TEXT_SCOPE.format("t.uid"), "true"),
            (
                "rejected event requeue",
                "REQUEUE_REJECTED_EVENT",
                "AND (CAST(:scope AS text) IS NULL",
                "AND (true",
            ),
        ]
    ),
]
