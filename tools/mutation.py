"""Mutation testing of the modules where a wrong line loses or corrupts data or security.

    python -m tools.mutation                       # every module below, this checkout
    python -m tools.mutation delivery/ssrf.py      # one module (or several)
    python -m tools.mutation --rev main --out /tmp/before.json   # another git revision

Two kinds of mutant, each judged by the fastest test subset that covers the module:

* Python modules go through mutmut (installed by the `mutation` extra): it flips
  operators, constants, conditions and arguments, and runs, for each mutant, only
  the tests of the subset that call the mutated function.
* SQL guards are plain strings to mutmut (it can only turn a whole statement into
  'XX...XX', which proves nothing about the guard). SQL_MUTANTS below removes or
  weakens one guard condition at a time; each mutant runs its own tests.

Everything happens in a scratch copy (`git archive` of the revision, or of the
working tree's files), so the checkout is never modified. One PostgreSQL server is
started for the whole run (OUTBOX_TEST_DATABASE_URL) instead of one per mutant.
The result is JSON: per module, mutants, killed, survivors (with each survivor's
diff). docs/mutation.md records the runs and explains the survivors. Slow: a full
run takes tens of minutes on a free machine; it is not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Module -> the fastest tests that pin its behaviour. Parametrized transports run on
# httpx only here: the transport is not what these modules decide.
MODULES: dict[str, list[str]] = {
    "delivery/policy.py": [
        "tests/test_policy.py",
        "tests/test_documented_rules.py",
        "-k",
        "not aiohttp",
    ],
    "outbox/endpoint_rules.py": ["tests/test_rules_config.py", "tests/test_tenant_scope.py"],
    "delivery/signing.py": ["tests/test_verify.py", "tests/test_delivery.py", "-k", "not aiohttp"],
    "delivery/verify.py": ["tests/test_verify.py"],
    "delivery/ssrf.py": ["tests/test_ssrf.py"],
    "delivery/reaper.py": ["tests/test_fencing.py", "tests/test_reaper.py", "-k", "not aiohttp"],
    "outbox/relay.py": [
        "tests/test_relay.py",
        "tests/test_tenant_routing.py",
        "tests/test_handoff.py",
    ],
    # The outcome of one attempt, against real loopback receivers (both transports).
    "delivery/http.py": [
        "tests/test_transport.py",
        "tests/test_documented_rules.py",
        "tests/test_bounded_requests.py",
        "tests/test_proxy.py",
        "tests/test_http_outcomes.py",
        "-k",
        # uvloop's handles warn when collected under mutmut's stats run (warnings are errors)
        "not in_every_process and not uvloop",
    ],
    # Claims, leases, outcome recording and the loop; the transport is not what it decides.
    "delivery/worker.py": [
        "tests/test_fencing.py",
        "tests/test_rules.py",
        "tests/test_delivery.py",
        "tests/test_documented_rules.py",
        "tests/test_handoff.py",
        "tests/test_claim_on_completion.py",
        "tests/test_worker_outcomes.py",
        "-k",
        "not httpx",
    ],
    "outbox/operations.py": [
        "tests/test_operations.py",
        "tests/test_operations_replay.py",
        "tests/test_operations_endpoints.py",
        "tests/test_operations_views.py",
        # Each write's own tenant scope (the lookup before it made unscoped on purpose).
        "tests/test_tenant_scope.py",
    ],
}


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
    "tests/test_fencing.py",
    "tests/test_rules.py",
    "-k",
    "not aiohttp and (lease or rescue or reaper or shutdown or late or release or outcome)",
)
_REPLAY = ("tests/test_operations.py",)
_HANDOFF = ("tests/test_handoff.py",)
_ROUTING = ("tests/test_relay.py", "tests/test_tenant_routing.py", "tests/test_publish.py")
Q = "delivery/queries.py"
OQ = "outbox/queries.py"

# Operator-side tenant scope: each mutant drops one statement's scope condition.
_SCOPE = (
    "tests/test_tenant_scope.py",
    "tests/test_tenant_api.py",
    "-k",
    "not unscoped and not deleted_tenant and not bad_tenant",
)
_TEXT_SCOPE = "(CAST(:scope AS text) IS NULL OR {} = :scope)"


def _S(column: str) -> str:
    """outbox/queries.py's source text of a scope condition on `column`."""
    return '{_in_scope("' + column + '")}'


def _AND_S(column: str) -> str:
    return " AND " + _S(column)


SQL_MUTANTS = [
    # claim
    SqlMutant(
        "claim: no claim number bump",
        Q,
        "updated_at = :now, claims = d.claims + 1",
        "updated_at = :now, claims = d.claims",
        _LEASES,
    ),
    SqlMutant(
        "claim: final re-check of state dropped",
        Q,
        "WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id\n"
        "      AND d.state = 'scheduled'",
        "WHERE d.id = due.id AND ev.id = d.event_id AND e.id = d.endpoint_id",
        ("tests/test_claim_contention.py", "tests/test_delivery.py", "-k", "not aiohttp"),
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
        OQ,
        "WHERE d.state = ANY(CAST(:allowed AS text[]))",
        "WHERE true",
        _REPLAY,
    ),
    SqlMutant(
        "replay: originals not locked (a concurrent replay does not wait)",
        OQ,
        "ORDER BY id FOR UPDATE",
        "ORDER BY id",
        ("tests/test_replay_once.py", "-k", "concurrent"),
    ),
    SqlMutant(
        "discard: in-flight rows not left alone",
        OQ,
        "AND state IN ('scheduled', 'dead')",
        "AND state IN ('scheduled', 'dead', 'in_flight')",
        _REPLAY,
    ),
    SqlMutant(
        "discard: terminal rows discarded again",
        OQ,
        "AND state IN ('scheduled', 'dead')",
        "",
        _REPLAY,
    ),
    # relay routing
    SqlMutant(
        "routing: disabled endpoints get deliveries",
        OQ,
        "WHERE x.id = r.endpoint_id AND x.enabled LIMIT 1",
        "WHERE x.id = r.endpoint_id LIMIT 1",
        _ROUTING,
    ),
    SqlMutant(
        "routing: tenant ignored",
        OQ,
        "WHERE pattern = c.pattern AND tenant_id = b.tenant_id",
        "WHERE pattern = c.pattern",
        _ROUTING,
    ),
    SqlMutant(
        "routing: all-tenants endpoints ignored",
        OQ,
        "            UNION ALL\n"
        "            SELECT endpoint_id FROM endpoint_subscriptions\n"
        "            WHERE pattern = c.pattern AND tenant_id IS NULL",
        "",
        _ROUTING,
    ),
    SqlMutant(
        "routing: no 'prefix.*' candidates",
        OQ,
        "WHERE substr(b.event_type, i, 1) = '.'",
        "WHERE substr(b.event_type, i, 1) = '_'",
        _ROUTING,
    ),
    SqlMutant(
        "routing: '*' is not a candidate",
        OQ,
        "SELECT '*' AS pattern\n    WHERE b.event_type NOT IN",
        "SELECT '*' AS pattern\n    WHERE false AND b.event_type NOT IN",
        _ROUTING,
    ),
    SqlMutant(
        "handoff: ordered endpoints handed off",
        OQ,
        "{HEALTH_GATED} OR h.ordered)",
        "{HEALTH_GATED})",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        # the gate condition is one fragment, shared with the claim and its quick path
        "handoff: open breaker ignored",
        OQ,
        "(h.breaker_state <> 'closed' OR ",
        "(false OR ",
        _HANDOFF,
        within="HEALTH_GATED = ",
    ),
    SqlMutant(
        "handoff: capped tenants handed off",
        OQ,
        "AND t.max_in_flight IS NULL AND t.max_per_second IS NULL",
        "",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: disabled tenants handed off",
        OQ,
        "WHERE t.id = e.tenant_id AND t.enabled",
        "WHERE t.id = e.tenant_id",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: the worker's slots left per endpoint ignored",
        OQ,
        "COALESCE(s.slots, :endpoint_slots)",
        ":endpoint_slots",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: more than the reserved slots",
        OQ,
        ":handoff_limit AS handed",
        ":handoff_limit + 1 AS handed",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "handoff: no lease on a handed-off delivery",
        OQ,
        "CAST(:lease_expires_at AS timestamptz) END",
        "NULL END",
        _HANDOFF,
        within="RELAY_BATCH_HANDOFF = text(",
    ),
    SqlMutant(
        "routing: events marked relayed twice (relayed_at filter dropped)",
        OQ,
        "WHERE relayed_at IS NULL AND NOT validate_pending\n    ORDER BY id",
        "WHERE NOT validate_pending\n    ORDER BY id",
        _ROUTING,
    ),
    SqlMutant(
        "rules: least specific max-attempts rule wins",
        OQ,
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern) DESC",
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern)",
        ("tests/test_documented_rules.py", "-k", "not aiohttp"),
    ),
    SqlMutant(
        "rules: exact type not preferred over an equally long prefix",
        OQ,
        "ORDER BY r.pattern = b.event_type DESC, length(r.pattern) DESC",
        "ORDER BY length(r.pattern) DESC",
        ("tests/test_documented_rules.py", "-k", "not aiohttp"),
    ),
    # a disabled tenant's deliveries wait (the claim only visits enabled tenants' heads)
    SqlMutant(
        "claim: disabled tenant not held",
        Q,
        "WHERE x.id = e.tenant_id AND x.enabled LIMIT 1",
        "WHERE x.id = e.tenant_id LIMIT 1",
        ("tests/test_tenant_core.py", "-k", "disabled_tenant"),
        within="LOCK_CLAIM_GATES = text(",
    ),
    # the quick path (QUICK_CLAIM_GATES) answers only when its batch is plain
    SqlMutant(
        "claim ranking: a disabled tenant taken as plain",
        Q,
        "SELECT y.enabled AND y.max_in_flight IS NULL",
        "SELECT y.max_in_flight IS NULL",
        ("tests/test_claim_rank.py", "-k", "falls_back"),
        within='_PLAIN = f"""',
    ),
    SqlMutant(
        "claim ranking: set-aside tenants' first turns not checked",
        Q,
        "        SELECT f.* FROM firsts f WHERE f.set_aside",
        "        SELECT f.* FROM firsts f WHERE false",
        ("tests/test_claim_rank.py", "-k", "falls_back"),
    ),
    *(
        SqlMutant(f"scope: {name}", OQ, old, new, _SCOPE, within=f"{statement} = ")
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
                "AND {_in_scope('tenant_id')}",
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
            ("stats counts by state", "STATS_COUNTS_BY_STATE", "{_in_scope('tenant_id')}", "true"),
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


def _export(rev: str | None, into: Path) -> None:
    """The revision's tracked files (or the working tree's) into a scratch folder."""
    if rev:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def _existing(copy: Path, selection: list[str] | tuple[str, ...]) -> list[str]:
    """Drop test files the revision does not have (an older revision lacks newer tests)."""
    out: list[str] = []
    skip_next = False
    for item in selection:
        if skip_next:
            skip_next = False
            out.append(item)
            continue
        if item == "-k":
            skip_next = True
            out.append(item)
        elif item.startswith("tests/") and not (copy / item).exists():
            continue
        else:
            out.append(item)
    return out


def _mutmut_module(copy: Path, module: str, selection: list[str]) -> dict[str, Any]:
    if not any(item.startswith("tests/") for item in _existing(copy, selection)):
        # Without test files the selection would be the whole suite: report, do not run.
        return {
            "module": module,
            "tests": selection,
            "mutants": 0,
            "counts": {"no tests": 1},
            "survivors": {},
            "seconds": 0.0,
            "mutmut_exit": 0,
            "mutmut_tail": "",
        }
    work = Path(tempfile.mkdtemp(prefix="mutmut-", dir=copy.parent))
    shutil.copytree(copy, work, dirs_exist_ok=True)
    package = module.split("/")[0]
    others = [
        p
        for p in ("outbox/", "delivery/", "migrations/", "bench/", "config/")
        if p != package + "/"
    ]
    config = {
        "source_paths": [package + "/"],
        "only_mutate": [module],
        "also_copy": [p for p in others if (work / p).exists()],
        "pytest_add_cli_args_test_selection": _existing(work, selection),
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q", "-x", "-p", "no:randomly"],
    }
    lines = ["", "[tool.mutmut]"] + [
        f"{key} = {json.dumps(value)}" for key, value in config.items()
    ]
    with (work / "pyproject.toml").open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    began = time.monotonic()
    mutmut = [sys.executable, "-m", "mutmut"]
    run = subprocess.run([*mutmut, "run"], cwd=work, capture_output=True, text=True)
    results = subprocess.run(
        [*mutmut, "results", "--all", "true"], cwd=work, capture_output=True, text=True
    ).stdout
    statuses: dict[str, str] = {}
    for line in results.splitlines():
        match = re.match(r"\s*(\S+): (.+)$", line)
        if match:
            statuses[match.group(1)] = match.group(2).strip()
    survivors = {}
    for name, status in statuses.items():
        if status in ("survived", "no tests", "timeout", "suspicious"):
            shown = subprocess.run(
                [*mutmut, "show", name], cwd=work, capture_output=True, text=True
            ).stdout
            survivors[name] = {"status": status, "diff": shown}
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    shutil.rmtree(work, ignore_errors=True)
    return {
        "module": module,
        "tests": selection,
        "mutants": len(statuses),
        "counts": counts,
        "survivors": survivors,
        "seconds": round(time.monotonic() - began, 1),
        "mutmut_exit": run.returncode,
        "mutmut_tail": run.stderr[-2000:] if run.returncode else "",
    }


def _sql_mutants(
    copy: Path, wanted: set[str] | None, match: str | None = None
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for mutant in SQL_MUTANTS:
        if wanted is not None and mutant.file not in wanted:
            continue
        if match is not None and match not in mutant.name:
            continue
        path = copy / mutant.file
        original = path.read_text()
        mutated = apply_mutant(original, mutant)
        if mutated is None:
            results.append({"name": mutant.name, "status": "not applicable", "tests": []})
            print(f"  sql: {mutant.name}: not applicable (text not found)", flush=True)
            continue
        tests = _existing(copy, mutant.tests)
        if not any(item.startswith("tests/") for item in tests):
            results.append({"name": mutant.name, "status": "no tests", "tests": []})
            print(f"  sql: {mutant.name}: no tests in this revision", flush=True)
            continue
        path.write_text(mutated)
        began = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                cwd=copy,
                capture_output=True,
                text=True,
                timeout=300,  # a hang is a kill: the tests did not pass
            )
            status = "killed" if done.returncode != 0 else "survived"
            summary = done.stdout.strip().splitlines()[-1:] if done.stdout else []
        except subprocess.TimeoutExpired:
            status, summary = "killed (timeout)", []
        finally:
            path.write_text(original)
        results.append(
            {
                "name": mutant.name,
                "status": status,
                "tests": tests,
                "summary": summary,
                "seconds": round(time.monotonic() - began, 1),
            }
        )
        print(f"  sql: {mutant.name}: {status}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: all of them)")
    parser.add_argument("--rev", help="a git revision to test instead of the working tree")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--no-sql", action="store_true", help="skip the SQL guard mutants")
    parser.add_argument("--sql-only", action="store_true", help="only the SQL guard mutants")
    parser.add_argument(
        "--sql-match", metavar="TEXT", help="only the SQL mutants whose name contains TEXT"
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES and m not in {Q, OQ}]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; choose from {', '.join(MODULES)}, {Q}, {OQ}")
    modules = [m for m in (args.modules or list(MODULES)) if m in MODULES]

    from outbox.embedded import EmbeddedPostgres

    report: dict[str, Any] = {"rev": args.rev or "working tree", "modules": [], "sql": []}
    with tempfile.TemporaryDirectory(prefix="outbox-mutation-") as scratch:
        root = Path(scratch)
        copy = root / "tree"
        copy.mkdir()
        _export(args.rev, copy)
        server = EmbeddedPostgres(root / "pg", delete_on_stop=True)
        os.environ["OUTBOX_TEST_DATABASE_URL"] = server.start()
        try:
            if not args.sql_only:
                for module in modules:
                    print(f"mutmut: {module}", flush=True)
                    result = _mutmut_module(copy, module, MODULES[module])
                    report["modules"].append(result)
                    if args.out:  # a long run keeps what it has so far
                        args.out.write_text(json.dumps(report, indent=2) + "\n")
                    print(
                        f"  {result['mutants']} mutants, {result['counts']}, {result['seconds']} s",
                        flush=True,
                    )
            if not args.no_sql:
                wanted = set(args.modules) & {Q, OQ} if args.modules else None
                report["sql"] = _sql_mutants(copy, wanted, args.sql_match)
        finally:
            server.stop()
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
