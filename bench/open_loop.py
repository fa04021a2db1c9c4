"""Ours in the open loop at fan-out 10, one process, one event per transaction, alone.

The configuration whose cost per delivery is about twice the instant drain's (issue 26,
docs/scaling.md), with its cost row and each step's, in a couple of minutes instead of
a full `python -m bench`: for comparing one change before and after, run by run.

    python -m bench.open_loop --rates 250,500,1000,2000 --out open-loop.json

`--statements` loads pg_stat_statements (the server restarts once) and adds the
service's calls and rows per statement over the run: passes per second of the relay,
rows per claim and per outcome write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import click
import psycopg
from psycopg.conninfo import make_conninfo

from bench.cluster import Cluster, Plan, ReceiverProcess
from bench.end_to_end import end_to_end
from bench.harness import _as_json, environment
from outbox.db import libpq_url

FANOUT = 10


def _load_pg_stat_statements(cluster: Cluster) -> None:
    cluster.preload("pg_stat_statements")
    with _admin(cluster) as admin:
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")


def _admin(cluster: Cluster) -> psycopg.Connection[Any]:
    return psycopg.connect(
        make_conninfo(libpq_url(cluster.url), dbname="postgres"), autocommit=True
    )


def _statements(cluster: Cluster, seconds: float) -> list[dict[str, Any]]:
    """Every statement run outside the `postgres` database since the reset (the run's)."""
    with _admin(cluster) as admin:
        found = admin.execute(
            "SELECT calls, rows, round(total_exec_time::numeric, 1), query"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname <> 'postgres' ORDER BY calls DESC"
        ).fetchall()
    return [
        {
            "calls": calls,
            "calls_per_s": round(calls / seconds, 1),
            "rows_per_call": round(rows / calls, 2) if calls else 0.0,
            "exec_ms": float(exec_ms),
            "query": " ".join(query.split())[:160],
        }
        for calls, rows, exec_ms, query in found
    ]


def _measure(plan: Plan, statements: bool) -> dict[str, Any]:
    with environment(plan) as (cluster, receiver, logs):  # it starts its own event loops
        if statements:
            _load_pg_stat_statements(cluster)
        return asyncio.run(_run(plan, cluster, receiver, logs, statements))


async def _run(
    plan: Plan, cluster: Cluster, receiver: ReceiverProcess, logs: Path, statements: bool
) -> dict[str, Any]:
    async with receiver.client():
        if statements:
            with _admin(cluster) as admin:
                admin.execute("SELECT pg_stat_statements_reset()")
        began = time.monotonic()
        outcome = _as_json(
            await end_to_end(
                cluster, receiver, plan, logs, system="ours", fanout=FANOUT, processes=1
            )
        )
        if statements:
            outcome["statements"] = _statements(cluster, time.monotonic() - began)
        return dict(outcome)


def _report(run: dict[str, Any]) -> list[str]:
    whole = run["cost"] or {}
    lines = [
        f"{run['name']}: sustained {run['sustained_deliveries_per_s']}/s;"
        f" whole run: outbox run {whole.get('service_cpu_ms')} ms,"
        f" PostgreSQL {whole.get('postgres_cpu_ms')} ms,"
        f" commits {whole.get('commits')}, WAL {whole.get('wal_bytes')} bytes per delivery",
        "  rate/s  p50 ms  p99 ms  outbox run ms  PostgreSQL ms  commits  WAL bytes",
    ]
    for step in run["steps"]:
        lat, c = step["latency_ms"], step.get("cost") or {}
        lines.append(
            f"  {step['target_deliveries_per_s']:>6}"
            f"  {lat.get('p50', '-'):>6}  {lat.get('p99', '-'):>6}"
            f"  {c.get('service_cpu_ms', '-'):>13}  {c.get('postgres_cpu_ms', '-'):>13}"
            f"  {c.get('commits', '-'):>7}  {c.get('wal_bytes', '-'):>9}"
        )
    for row in run.get("statements", [])[:15]:
        lines.append(
            f"  {row['calls_per_s']:>8}/s  {row['rows_per_call']:>7} rows  {row['exec_ms']:>9} ms"
            f"  {row['query']}"
        )
    return lines


@click.command()
@click.option(
    "--rates", default="250,500,1000,2000", show_default=True, help="Deliveries/s, in order."
)
@click.option("--step-seconds", type=float, default=4.0, show_default=True)
@click.option("--statements", is_flag=True, help="Add pg_stat_statements' calls and rows.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(rates: str, step_seconds: float, statements: bool, out: Path | None) -> None:
    """Ours at fan-out 10, one process, one event per transaction: cost and latency."""
    ladder = tuple(int(rate) for rate in rates.split(","))
    plan = dataclasses.replace(Plan(), ours_rates=ladder, step_seconds=step_seconds, peer=False)
    run = _measure(plan, statements)
    click.echo("\n".join(_report(run)))
    if out is not None:
        out.write_text(json.dumps(run, indent=2))


if __name__ == "__main__":
    main()
