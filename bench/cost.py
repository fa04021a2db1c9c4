"""The whole cost of a delivery against the floor (issue 26), in CPU time.

CPU time, not wall time: a shared box slows a run down, but it moves what each
delivery costs much less than it moves rates.

- **Whole cost**: the CPU of everything the service runs, per delivery: the
  `outbox run` processes (relay, worker, reaper) plus PostgreSQL, all of it, while
  the service works: the backends serving its connections and the server's own
  processes (WAL writer, checkpointer, autovacuum: the postmaster reaps them, so
  those that exit in the window still count, through its cutime and cstime).
  In the open loop the application's publishing backends are taken out (the
  application's own cost, not the service's); what they made the server's
  background processes do stays in. WAL bytes and commits per delivery beside it
  (in the open loop they include the application's publishing transactions: a
  primary carries those too).
- **Floor**: the least any durable queue in front of an HTTP client must spend:
  the raw HTTP client's CPU per request (the drain's raw-ceiling run) plus
  PostgreSQL's CPU per job for inserting a row and marking it done, in batches of
  the worker's claim size, one commit per batch (`floor_queue`, against the same
  server).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.db import libpq_url

TARGET = 1.5
CAPACITY_ERROR = 0.25  # the model's predicted 2-process rate within this of the measured
_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> float:
    """utime + stime of one process, in seconds (0 once it is gone)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / _TICK
    return 0.0


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def server_cpu(postmaster: int) -> float:
    """Every CPU second the server has used: the postmaster, its live children, and the
    children it already reaped (cutime + cstime), so exited backends still count."""
    total = 0.0
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = _stat_fields(postmaster)
        total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK
    return total + sum(process_cpu(child) for child in _children(postmaster))


@dataclass(slots=True)
class Snapshot:
    """CPU and counters at one instant; two of them make a window."""

    service: float  # the service's own processes (outbox run and its children)
    server: float  # the whole PostgreSQL server
    excluded: dict[int, float]  # backends not the service's (the application's), by pid
    backends: dict[int, float]  # the database's other backends, by pid (the service's)
    commits: int
    wal: int
    box: float = 0.0  # every core's busy time on the machine (/proc/stat), for the load
    receiver: float = 0.0  # the bench's receiver (the partner), not part of the whole
    at: float = 0.0  # monotonic time
    bench: float = 0.0  # this process (the producer, in the open loop)


def box_busy() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, /proc/stat)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / _TICK
    return 0.0


def _admin(url: str) -> psycopg.Connection[Any]:
    """A connection to the server's `postgres` database: reading the counters must not
    add commits to the database being measured."""
    return psycopg.connect(make_conninfo(libpq_url(url), dbname="postgres"), autocommit=True)


def snapshot(
    url: str,
    postmaster: int,
    service_cpu: float,
    excluded: Iterable[int] = (),
    receiver: int | None = None,
) -> Snapshot:
    """Read everything once; `excluded` are backend pids whose CPU is not the service's."""
    skip = set(excluded)
    database = conninfo_to_dict(libpq_url(url)).get("dbname")
    with _admin(url) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %s),"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            (database,),
        ).fetchone()
        assert row is not None
        pids = [
            int(pid)
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                " AND backend_type = 'client backend'",
                (database,),
            ).fetchall()
        ]
    return Snapshot(
        service=service_cpu,
        server=server_cpu(postmaster),
        excluded={pid: process_cpu(pid) for pid in skip},
        backends={pid: process_cpu(pid) for pid in pids if pid not in skip},
        commits=int(row[0]),
        wal=int(row[1]),
        box=box_busy(),
        receiver=process_cpu(receiver) if receiver else 0.0,
        at=time.monotonic(),
        bench=time.process_time(),
    )


def window(
    before: Snapshot, after: Snapshot, deliveries: int, *, commits_not_ours: int = 0
) -> dict[str, Any]:
    """Per delivery between two snapshots: the service's processes, PostgreSQL (whole
    server minus the application's backends), of which the service's backends, WAL,
    commits (less `commits_not_ours`, the application's transactions)."""
    n = max(deliveries, 1)
    excluded = sum(after.excluded.get(p, 0.0) - c for p, c in before.excluded.items())
    backends = sum(cpu - before.backends.get(pid, 0.0) for pid, cpu in after.backends.items())
    service = after.service - before.service
    postgres = after.server - before.server - excluded
    seconds = max(after.at - before.at, 1e-9)
    box = after.box - before.box
    return {
        "deliveries": deliveries,
        "seconds": round(seconds, 3),
        # The load: how many of the machine's cores were busy, on average, over the
        # window, and how many of those were not this run (service, server, receiver,
        # this process).
        "box_busy_cores": round(box / seconds, 2),
        "others_busy_cores": round(
            (
                box
                - service
                - (after.server - before.server)
                - (after.receiver - before.receiver)
                - (after.bench - before.bench)
            )
            / seconds,
            2,
        ),
        "receiver_cpu_ms": round((after.receiver - before.receiver) * 1000 / n, 4),
        "service_cpu_ms": round(service * 1000 / n, 4),
        "postgres_cpu_ms": round(postgres * 1000 / n, 4),
        "postgres_backends_cpu_ms": round(backends * 1000 / n, 4),
        "application_backends_cpu_ms": round(excluded * 1000 / n, 4),
        "whole_cpu_ms": round((service + postgres) * 1000 / n, 4),
        "wal_bytes": round((after.wal - before.wal) / n),
        "commits": round((after.commits - before.commits - commits_not_ours) / n, 3),
        "application_commits": round(commits_not_ours / n, 3),
    }


def add(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two per-delivery costs of the same deliveries (the relay before a drain, the drain)."""
    keys = ("service_cpu_ms", "postgres_cpu_ms", "postgres_backends_cpu_ms", "whole_cpu_ms")
    found = {k: round(first[k] + second[k], 4) for k in keys}
    found["wal_bytes"] = first["wal_bytes"] + second["wal_bytes"]
    found["commits"] = round(first["commits"] + second["commits"], 3)
    found["deliveries"] = second["deliveries"]
    found["application_backends_cpu_ms"] = 0.0
    found["application_commits"] = 0.0
    return found


def table_stats(url: str) -> dict[str, Any]:
    """`deliveries`' indexes (with how often each was read) and its HOT update ratio."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        indexes = {
            str(name): int(scans)
            for name, scans in conn.execute(
                "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes"
                " WHERE relname = 'deliveries' ORDER BY indexrelname"
            ).fetchall()
        }
        row = conn.execute(
            "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,"
            " current_setting('server_version_num')::int,"
            " (SELECT reloptions FROM pg_class WHERE relname = 'deliveries')"
            " FROM pg_stat_user_tables WHERE relname = 'deliveries'"
        ).fetchone()
        # Every table the run updated, with its HOT share: where a fillfactor could help.
        updated = {
            str(name): {"updates": int(upd), "hot_updates": int(hot)}
            for name, upd, hot in conn.execute(
                "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                " WHERE n_tup_upd > 0 ORDER BY relname"
            ).fetchall()
        }
    assert row is not None
    inserts, updates, hot, deletes, _, options = row
    return {
        "indexes": len(indexes),
        "index_scans": indexes,
        "inserts": int(inserts),
        "updates": int(updates),
        "hot_updates": int(hot),
        "hot_ratio": round(int(hot) / int(updates), 3) if updates else 0.0,
        "deletes": int(deletes),
        "reloptions": list(options or []),
        "updated_tables": updated,
    }


def floor_queue(url: str, postmaster: int, jobs: int, batch: int) -> dict[str, Any]:
    """PostgreSQL's CPU for the least a durable queue does per job: insert it (a batch of
    `batch` rows, one commit), then mark it done (the same batch, one commit)."""
    payload = json.dumps({"order_id": 123456, "customer": "cus_8f2a", "total_cents": 4999})
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE floor_jobs (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,"
            " payload jsonb NOT NULL, done_at timestamptz)"
        )
    before = snapshot(url, postmaster, 0.0)
    began = time.perf_counter()
    # The connection closes inside the window: its backend's exit flushes its commit
    # counts, and its CPU is the server's (reaped by the postmaster).
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for start in range(0, jobs, batch):
            size = min(batch, jobs - start)
            with conn.transaction():
                ids = [
                    int(i)
                    for (i,) in conn.execute(
                        "INSERT INTO floor_jobs (payload)"
                        " SELECT CAST(%s AS jsonb) FROM generate_series(1, %s) RETURNING id",
                        (payload, size),
                    ).fetchall()
                ]
            with conn.transaction():
                conn.execute("UPDATE floor_jobs SET done_at = now() WHERE id = ANY(%s)", (ids,))
    seconds = time.perf_counter() - began
    wait_for_exit(url)
    after = snapshot(url, postmaster, 0.0)
    measured = window(before, after, jobs)
    return {
        "jobs": jobs,
        "batch": batch,
        "seconds": round(seconds, 3),
        "postgres_cpu_ms": measured["postgres_cpu_ms"],
        "wal_bytes": measured["wal_bytes"],
        "commits": measured["commits"],
    }


def wait_for_exit(url: str, seconds: float = 5.0) -> None:
    """Until no backend is connected to the database (a closed connection's backend
    exits a moment later; its counters and CPU are final only then)."""
    database = conninfo_to_dict(libpq_url(url)).get("dbname")
    deadline = time.monotonic() + seconds
    with _admin(url) as conn:
        while time.monotonic() < deadline:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
            ).fetchone()
            if row is None or not row[0]:
                return
            time.sleep(0.01)


def floor(ceiling: dict[str, Any], queue: dict[str, Any]) -> dict[str, Any]:
    """The floor per delivery: the raw client's CPU per request plus the queue's PostgreSQL CPU."""
    http = ceiling["client_cpu_ms_per_request"]
    return {
        "http_client_cpu_ms": http,
        "queue_postgres_cpu_ms": queue["postgres_cpu_ms"],
        "cpu_ms": round(http + queue["postgres_cpu_ms"], 4),
        "queue": queue,
    }


def ratio(whole: dict[str, Any], floor_: dict[str, Any]) -> float:
    return round(float(whole["whole_cpu_ms"]) / max(float(floor_["cpu_ms"]), 1e-9), 2)


def closed_loop_rate(one_process_per_s: float, box_share: float, processes: int) -> float:
    """Deliveries/s of `processes` loops sharing one box, from one loop alone (exact mean
    value analysis of a closed network: one queue, the box's cores pooled, and a delay).

    One process alone delivers `one_process_per_s` and keeps `box_share` of the box's
    cores busy (its rate x the whole CPU of a delivery / cores). Per delivery it spends
    box_share / rate on the box and the rest of 1 / rate waiting on nothing shared (round
    trips, commits' flushes, the partner). A process that joins others finds, on
    average, the box busy with their work, and waits for it: each added process raises
    the rate by less, and the rate nears cores / CPU per delivery but never passes it."""
    demand = box_share / one_process_per_s  # seconds of the whole box per delivery
    delay = 1 / one_process_per_s - demand
    queued, rate = 0.0, 0.0
    for n in range(1, processes + 1):
        residence = demand * (1 + queued)
        rate = n / (residence + delay)
        queued = rate * residence
    return rate


def capacity(drains: dict[str, Any], cpus: int) -> dict[str, Any] | None:
    """docs/scaling.md's model, checked on this run's instant drains: the rate of 2
    processes predicted from the 1-process drain alone. The two bounds (twice what one
    process drains; the box's cores over the whole CPU a delivery costs: service,
    PostgreSQL and the partner) and, under both, what queueing for the shared cores leaves
    (`closed_loop_rate`): the prediction."""
    one, two = drains.get("instant_1", {}), drains.get("instant_2", {})
    if "cost" not in one or "cost" not in two or not one["deliveries_per_s"]:
        return None
    spent = one["cost"]["drain"]
    per_delivery = spent["whole_cpu_ms"] + spent["receiver_cpu_ms"]
    box_bound = cpus * 1000 / per_delivery
    one_rate = one["deliveries_per_s"]
    # The cores left to the service: what else ran on the box during the 1-process drain
    # (none on a quiet box) takes its share of them from the second process too.
    others = min(max(float(spent.get("others_busy_cores", 0.0)), 0.0), cpus * 0.9)
    box_share = min(one_rate * per_delivery / 1000 / (cpus - others), 1.0)
    bounds = min(2 * one_rate, box_bound)
    predicted = closed_loop_rate(one_rate, box_share, 2)
    measured = two["deliveries_per_s"]
    return {
        "cpus": cpus,
        "cpu_ms_per_delivery": round(per_delivery, 4),
        "one_process_per_s": one_rate,
        "others_busy_cores": round(others, 2),
        # The same during the 2-process drain: the check compares like with like only if
        # the box's other load stayed about the same (it does on a quiet box).
        "others_busy_cores_2": two["cost"]["drain"].get("others_busy_cores"),
        "one_process_box_share": round(box_share, 3),
        "box_bound_per_s": round(box_bound),
        "bounds_2_per_s": round(bounds),
        "predicted_2_per_s": round(predicted),
        "measured_2_per_s": measured,
        "error": round(predicted / measured - 1, 3) if measured else None,
        "bounds_error": round(bounds / measured - 1, 3) if measured else None,
    }
