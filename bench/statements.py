"""Where PostgreSQL's share of a delivery goes, per statement and per table (issue 26).

`python -m bench.statements [--runs N] [--backlog N]` runs the 1-process instant drain
(bench/drain.py, the cost rows' own) N times on one server with pg_stat_statements
loaded, and prints, per run: the cost row (PostgreSQL CPU ms and WAL bytes per delivery,
relay included), then per statement its execution time, rows and WAL (bytes and full
page images) per delivery, the tables' row counters and the average width of the row
versions a delivery leaves. The statements' times are the backends' execution only
(no parse, network or commit); the cost row is the whole server's CPU.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import click
import psycopg

from bench.cluster import Cluster, Plan, ReceiverProcess
from bench.drain import drain
from bench.harness import environment
from outbox.db import libpq_url

_STATEMENTS = """
    SELECT s.query, s.calls, s.rows, s.total_exec_time, s.wal_bytes, s.wal_records, s.wal_fpi
    FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
    WHERE d.datname = current_database() AND s.total_exec_time > 0
    ORDER BY s.total_exec_time DESC
"""

_TABLES = """
    SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd,
           pg_relation_size(relid), pg_indexes_size(relid)
    FROM pg_stat_user_tables
    WHERE relname IN ('deliveries', 'delivery_attempts', 'outbox_events')
    ORDER BY relname
"""

_WIDTHS = """
    SELECT 'deliveries', avg(pg_column_size(d.*)), NULL::numeric FROM deliveries d
    UNION ALL
    SELECT 'delivery_attempts', avg(pg_column_size(a.*)), avg(pg_column_size(a.request_headers))
    FROM delivery_attempts a
    UNION ALL
    SELECT 'outbox_events', avg(pg_column_size(e.*)), avg(pg_column_size(e.payload))
    FROM outbox_events e
"""


# auto_explain (--explain-to): every statement's plan with its run time, its foreign-key
# triggers' time and its WAL, in the server's log. Timing every node slows the server:
# read the plans for shares, and the cost rows of runs without it.
_AUTO_EXPLAIN = {
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_triggers": "on",
    "auto_explain.log_wal": "on",
}


def _enable_pg_stat_statements(cluster: Cluster, explain: bool = False) -> str:
    """Load the extension (a restart with the options the server started with); with
    `explain`, auto_explain too. Returns the server's log file."""
    libraries = ("pg_stat_statements", "auto_explain") if explain else ("pg_stat_statements",)
    settings = {"pg_stat_statements.track": "all", **(_AUTO_EXPLAIN if explain else {})}
    log = cluster.preload(*libraries, settings=settings)
    with psycopg.connect(
        libpq_url(cluster.database_url("bench_template")), autocommit=True
    ) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return str(log)


_PLAN = re.compile(r"LOG:  duration: ([\d.]+) ms  plan:")
_NODE = re.compile(r"((?:Update|Insert) on \S+)[^\n]*actual time=[\d.]+\.\.([\d.]+) rows")
_TRIGGER = re.compile(r"Trigger for constraint (\S+) on \S+: time=([\d.]+) calls=(\d+)")
_KINDS = {"WITH outcome AS": "record", "WITH batch AS": "relay pass", "pending AS": "claim"}


def explained(log: str, deliveries: int) -> dict[str, dict[str, float]]:
    """From auto_explain's plans in `log`: per hot statement (relay pass, claim, record),
    its time, its row-writing nodes' and its foreign-key triggers' time, in µs per
    delivery (a trigger's time is not in its node's: constraint checks run after the
    statement)."""
    found: dict[str, dict[str, float]] = {}
    for block in re.split(r"\n(?=\S.*LOG:  duration: )", log):
        duration = _PLAN.search(block)
        text = " ".join(block.partition("Query Text:")[2].split())[:80]
        kind = next((name for key, name in _KINDS.items() if key in text), None)
        if duration is None or kind is None:
            continue
        totals = found.setdefault(kind, {})

        def add(name: str, ms: float, totals: dict[str, float] = totals) -> None:
            totals[name] = totals.get(name, 0.0) + ms * 1000 / deliveries

        add("statement", float(duration.group(1)))
        for node, ms in _NODE.findall(block):
            add(node, float(ms))
        for constraint, ms, _ in _TRIGGER.findall(block):
            add(f"trigger {constraint}", float(ms))
    return {kind: {k: round(v, 1) for k, v in totals.items()} for kind, totals in found.items()}


def _settings(variant: str) -> list[str]:
    """The statements that make a fresh database variant `variant` (see --variant)."""
    if variant == "A":
        return []
    if variant.startswith("drop:"):  # an experiment: what one constraint costs
        table, _, constraint = variant.removeprefix("drop:").rpartition(".")
        return [f"ALTER TABLE {table or 'deliveries'} DROP CONSTRAINT {constraint}"]
    found = []
    for part in variant.removeprefix("ff").split(","):
        table, _, value = part.partition("=")
        found.append(f"ALTER TABLE {table} SET (fillfactor = {int(value)})")
    return found


def _probe(url: str, deliveries: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        statements = [
            {
                "query": " ".join(str(query).split())[:110],
                "calls": int(calls),
                "rows_per_delivery": round(int(rows) / deliveries, 3),
                "exec_us_per_delivery": round(float(ms) * 1000 / deliveries, 2),
                "wal_bytes_per_delivery": round(int(wal) / deliveries),
                "wal_records_per_delivery": round(int(records) / deliveries, 2),
                "wal_fpi_per_delivery": round(int(fpi) / deliveries, 3),
            }
            for query, calls, rows, ms, wal, records, fpi in conn.execute(_STATEMENTS).fetchall()
        ]
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        tables = {
            str(name): {
                "inserts": int(ins),
                "updates": int(upd),
                "hot_updates": int(hot),
                "heap_bytes": int(heap),
                "index_bytes": int(index),
            }
            for name, ins, upd, hot, heap, index in conn.execute(_TABLES).fetchall()
        }
        widths = {
            str(name): {
                "row_bytes": round(float(row or 0)),
                "json_bytes": round(float(js)) if js is not None else None,
            }
            for name, row, js in conn.execute(_WIDTHS).fetchall()
        }
    return {"statements": statements, "tables": tables, "widths": widths}


def _runs(
    runs: int, backlog: int, variants: list[str], explain_to: Path | None = None
) -> list[dict[str, Any]]:
    plan = Plan()
    with environment(plan) as (cluster, receiver, logs):
        log = _enable_pg_stat_statements(cluster, explain=explain_to is not None)
        try:
            return asyncio.run(_drains(cluster, receiver, plan, logs, runs, backlog, variants))
        finally:
            if explain_to is not None:
                shutil.copyfile(log, explain_to)
                plans = explained(Path(log).read_text(errors="replace"), runs * backlog)
                click.echo(json.dumps(plans, indent=1))


class _Prepared:
    """The cluster, with each new database set up for its variant and the statement
    counters reset just before the drain's own work starts."""

    def __init__(self, cluster: Cluster, settings: list[str]) -> None:
        self._cluster = cluster
        self._settings = settings
        self.url = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cluster, name)

    def new_database(self, label: str) -> str:
        name = self._cluster.new_database(label)
        self.url = self._cluster.database_url(name)
        with psycopg.connect(libpq_url(self.url), autocommit=True) as conn:
            for setting in self._settings:
                conn.execute(setting)
            conn.execute("SELECT pg_stat_statements_reset()")
        return name


async def _drains(
    cluster: Cluster,
    receiver: ReceiverProcess,
    plan: Plan,
    logs: Path,
    runs: int,
    backlog: int,
    variants: list[str],
) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    async with receiver.client():
        for number, label in enumerate(v for _ in range(runs) for v in variants):
            prepared = _Prepared(cluster, _settings(label))
            row = await drain(prepared, receiver, plan, logs, backlog=backlog, path="/drain")  # type: ignore[arg-type]
            whole = row["cost"]["whole"]
            found.append(
                {
                    "label": label,
                    "run": number,
                    "postgres_cpu_ms": whole["postgres_cpu_ms"],
                    "wal_bytes": whole["wal_bytes"],
                    "relay": {k: row["cost"]["relay"][k] for k in ("postgres_cpu_ms", "wal_bytes")},
                    "drain": {
                        k: row["cost"]["drain"][k]
                        for k in ("postgres_cpu_ms", "wal_bytes", "commits")
                    },
                    "deliveries_per_s": row["deliveries_per_s"],
                    **_probe(prepared.url, backlog),
                }
            )
            click.echo(json.dumps(found[-1]), err=True)
    return found


@click.command()
@click.option("--runs", default=1, show_default=True)
@click.option("--backlog", default=Plan().drain_backlog, show_default=True)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    default=["A"],
    help="Runs alternate between these (repeatable). A: as migrated; "
    "ff<table>=<N>[,...]: that table's fillfactor set on the fresh database first; "
    "drop:[<table>.]<constraint>: that constraint (of deliveries) dropped first.",
)
@click.option("--json-out", type=click.Path(path_type=Path))
@click.option(
    "--explain-to",
    type=click.Path(path_type=Path),
    help="Load auto_explain too and copy the server's log (every plan, with its foreign-key "
    "triggers' time and WAL) here. It slows the server: its cost rows are not comparable.",
)
def main(
    runs: int,
    backlog: int,
    variants: tuple[str, ...],
    json_out: Path | None,
    explain_to: Path | None,
) -> None:
    found = _runs(runs, backlog, list(variants), explain_to)
    for row in found:
        click.echo(
            f"{row['label']} run {row['run']}: PostgreSQL {row['postgres_cpu_ms']:.4f} ms, "
            f"WAL {row['wal_bytes']} B per delivery (relay {row['relay']}, "
            f"drain {row['drain']}), {row['deliveries_per_s']}/s"
        )
    if json_out:
        json_out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
