"""Backlog drains (issue 11): how close `outbox run` gets to its slots and to the wire.

Three measurements, each a ratio taken in one run so that the shared box's load
hits both sides of it alike:

- **slow partner**: a one-endpoint backlog to a receiver that answers every
  request after `latency` seconds. A worker may hold `endpoint_slots` requests to
  one endpoint, so the most it can do is slots / latency deliveries per second;
  the row is the drain rate as a share of that.
- **instant partner**: the same backlog shape to a receiver that answers at once,
  against the raw ceiling: a bare aiohttp client (uvloop when installed, same body,
  as many concurrent requests as the worker's slots for one endpoint) to the same
  receiver, measured just before.
- **processes**: the instant drain with `outbox run --processes 2` over 1.

A drain is timed from the backlog's first arrival at the receiver to its last
answer (the last arrival plus the partner's latency), so process start-up is not
counted; with several processes, from the first arrival after every one of them holds
a claim (the later ones' start-up is not the drain's either). The backlog is built
(published and relayed) before the workers start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

from bench import cost
from bench.ceiling import client_in_process
from bench.cluster import (
    EVENT_TYPE,
    LOOPBACK,
    PAYLOAD,
    Cluster,
    Plan,
    ReceiverProcess,
    WorkerProcesses,
    ours_commands,
)
from bench.components import _preload_events, _vacuum
from delivery.worker import WorkerConfig, render_body
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import libpq_url, make_async_engine, sqlalchemy_url
from outbox.relay import Relay, RelayConfig

# How long a multi-process drain's window waits for every process to hold a claim.
PATIENCE = 3.0
TARGETS = {"slow_share_of_slots": 0.8, "instant_share_of_ceiling": 0.35, "two_over_one": 1.4}


def endpoint_slots(plan: Plan) -> int:
    """The slots one endpoint may hold in one worker process with the bench's settings."""
    return WorkerConfig(max_in_flight=plan.worker_max_in_flight).endpoint_slots


async def drain(
    cluster: Cluster,
    receiver: ReceiverProcess,
    plan: Plan,
    logs: Path,
    *,
    backlog: int,
    path: str,
    processes: int = 1,
    latency: float = 0.0,
    concurrency: str = "fixed",
) -> dict[str, Any]:
    """Deliver a `backlog`-row one-endpoint backlog with `outbox run --processes N`; the
    endpoint's `concurrency` is "fixed" (its slots from the start) or "adaptive" (the
    default for a new endpoint: its limit grows from a few while the partner keeps up)."""
    database = cluster.new_database("drain")
    url = cluster.database_url(database)
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    _preload_events(url, backlog, 1, receiver.url(f"{path}/{database}"), box, concurrency)
    postmaster = cluster.postmaster_pid()
    engine = make_async_engine(url, pool_pre_ping=False)
    # The relay's share of the whole cost: it runs here, before the workers start.
    relay_from = cost.snapshot(url, postmaster, time.process_time())
    await Relay(engine, SystemClock(), RelayConfig(batch_size=2000)).run_until_idle()
    await engine.dispose()
    relay_to = cost.snapshot(url, postmaster, time.process_time())
    _vacuum(url)
    await receiver.arrivals()  # forget earlier runs' arrivals
    before = await receiver.count()
    workers = WorkerProcesses(
        ours_commands(processes),
        {
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_SECRET_KEYS": key_setting,
            "OUTBOX_WORKER_MAX_IN_FLIGHT": str(plan.worker_max_in_flight),
            "OUTBOX_WORKER_BATCH_SIZE": str(plan.worker_batch_size),
            "OUTBOX_ALLOWED_NETWORKS": LOOPBACK,
            "OUTBOX_LOG_LEVEL": "WARNING",
            "OUTBOX_EVENT_LOOP": plan.event_loop,
        },
        logs / f"{database}.log",
    )
    workers.start()
    deadline = time.time() + 60 + backlog / 50
    # (arrived, worker CPU s, whole-cost snapshot) once the drain began
    cpu_from: tuple[int, float, cost.Snapshot] | None = None
    live_after = 0.0  # seconds from the first arrival until every process delivered
    all_claimed = processes == 1
    try:
        # The receiver answers at the first arrival (the window starts), then at the
        # backlog's last: nothing polls while the workers start and deliver.
        arrived = 0
        while arrived < backlog:
            arrived = await receiver.wait_for(before + (backlog if cpu_from else 1)) - before
            if cpu_from is None and arrived:
                # The window opens once every process delivers: a later process's start-up
                # (imports, connections, its first plans) is not the drain's rate or cost.
                # At most PATIENCE: a process that claims nothing by then (another holds
                # the endpoint's whole limit) is part of what the drain measures. A backlog
                # gone before that, or a window that would open with less than half of it
                # left (the quick run's small backlog), opens at the first arrival instead.
                first_at = time.monotonic()
                worker_cpu = workers.cpu_seconds()
                cpu_from = (
                    arrived,
                    worker_cpu,
                    cost.snapshot(url, postmaster, worker_cpu, receiver=receiver.pid),
                )
                waited = await _all_claiming(url, processes, min(deadline, time.time() + PATIENCE))
                if processes > 1 and waited != "gone":
                    live_after = time.monotonic() - first_at
                    all_claimed = waited == "all"
                    claimed_at = await receiver.count() - before
                    if claimed_at > arrived and backlog - claimed_at >= backlog // 2:
                        arrived = claimed_at
                        worker_cpu = workers.cpu_seconds()
                        cpu_from = (
                            arrived,
                            worker_cpu,
                            cost.snapshot(url, postmaster, worker_cpu, receiver=receiver.pid),
                        )
            if arrived < backlog and time.time() > deadline:
                raise RuntimeError(f"drain of {backlog} did not finish; see {logs}")
        cpu_to = workers.cpu_seconds()
        await _recorded(url, backlog, deadline)
        whole_to = cost.snapshot(url, postmaster, workers.cpu_seconds(), receiver=receiver.pid)
    finally:
        workers.stop()
    # Commits and WAL once the workers' backends are gone (their counters are flushed
    # at exit, at most once a second before): the drain's, and a shutdown's few.
    cost.wait_for_exit(url)
    settled = cost.snapshot(url, postmaster, 0.0)
    whole_to.commits, whole_to.wal = settled.commits, settled.wal
    start_count, start_cpu, whole_from = cpu_from or (0, cpu_to, whole_to)
    delivered = cost.window(whole_from, whole_to, backlog - start_count)
    relayed = cost.window(relay_from, relay_to, backlog)
    arrivals = await receiver.arrivals()
    times = sorted(t for _, t in arrivals)
    # The last request is answered `latency` after it arrived: that is when the drain ends.
    # Timed from the first arrival after every process delivers (`start_count` arrived
    # before), so the rate and the cost cover the same window.
    opened = min(start_count, len(times) - 1)
    seconds = times[-1] - times[opened] + latency if times else 0.0
    from_first = times[-1] - times[0] + latency if times else 0.0
    return {
        "backlog": backlog,
        "processes": processes,
        "concurrency": concurrency,
        "path": path,
        "arrived": len(times),
        "distinct": len({message_id for message_id, _ in arrivals}),
        "seconds": round(seconds, 3),
        "deliveries_per_s": round((len(times) - opened) / seconds) if seconds > 0 else 0,
        # Before every process delivered: how long that took after the first arrival, the
        # deliveries it saw, and the rate had the window opened at the first arrival.
        "startup": {
            "seconds": round(live_after, 3),
            "all_processes_claimed": all_claimed,
            "deliveries": opened,
            "deliveries_per_s_from_first_arrival": (
                round(len(times) / from_first) if from_first > 0 else 0
            ),
        },
        # Contention-proof: worker CPU (all its processes) per delivery during the drain.
        "worker_cpu_ms_per_delivery": round(
            (cpu_to - start_cpu) * 1000 / max(backlog - start_count, 1), 3
        ),
        # Issue 26: the whole cost per delivery (bench/cost.py): the relay's fan-out
        # before the workers start, plus the drain (claim, send, record) from the first
        # arrival until every outcome is written; and `deliveries`' indexes and HOT ratio.
        "cost": {
            "relay": relayed,
            "drain": delivered,
            "whole": cost.add(relayed, delivered),
            "table": cost.table_stats(url),
        },
    }


async def _all_claiming(url: str, processes: int, deadline: float) -> str:
    """Wait until `processes` workers hold claims (a process holds some once it delivers):
    "all"; "waited" at `deadline` before that; "gone" if the backlog had no scheduled row
    left before either."""
    if processes <= 1:
        return "all"
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as conn:
        while time.time() < deadline:
            row = await (
                await conn.execute(
                    "SELECT (SELECT count(DISTINCT locked_by) FROM deliveries"
                    " WHERE state = 'in_flight'),"
                    " EXISTS (SELECT 1 FROM deliveries WHERE state = 'scheduled')"
                )
            ).fetchone()
            assert row is not None
            if row[0] >= processes:
                return "all"
            if not row[1]:
                return "gone"
            await asyncio.sleep(0.002)
    return "waited"


async def _recorded(url: str, backlog: int, deadline: float) -> None:
    """Wait until every outcome of the drain is written (arrival comes before the record)."""
    engine = create_engine(sqlalchemy_url(url))
    try:
        while True:
            with engine.connect() as conn:
                done = conn.execute(
                    text("SELECT count(*) FROM deliveries WHERE state = 'succeeded'")
                ).scalar_one()
            if done >= backlog or time.time() > deadline:
                return
            await asyncio.sleep(0.02)
    finally:
        engine.dispose()


async def raw_ceiling(receiver: ReceiverProcess, plan: Plan) -> dict[str, Any]:
    """Requests/s of a bare aiohttp client in its own process, the webhook body, one endpoint."""
    body = render_body(EVENT_TYPE, SystemClock().now(), _payload_json())
    concurrency = endpoint_slots(plan)
    context = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        rate, cpu_ms = await loop.run_in_executor(
            pool,
            client_in_process,
            receiver.url("/ceiling"),
            body,
            concurrency,
            plan.transport_seconds,
        )
    await receiver.arrivals()
    return {
        "requests_per_s": rate,
        "concurrency": concurrency,
        "body_bytes": len(body),
        "client_cpu_ms_per_request": cpu_ms,
    }


def _payload_json() -> str:
    import json

    return json.dumps(PAYLOAD)


async def drains(
    cluster: Cluster, receiver: ReceiverProcess, plan: Plan, logs: Path
) -> dict[str, Any]:
    """Every drain row with its ratio, target and verdict."""
    latency_ms = round(plan.drain_latency * 1000)
    slots = endpoint_slots(plan)
    slow = await drain(
        cluster,
        receiver,
        plan,
        logs,
        backlog=plan.drain_slow_backlog,
        path=f"/wait/{latency_ms}",
        latency=plan.drain_latency,
    )
    ceiling = await raw_ceiling(receiver, plan)
    queue = cost.floor_queue(
        cluster.database_url(cluster.new_database("floor")),
        cluster.postmaster_pid(),
        plan.floor_jobs,
        plan.worker_batch_size,
    )
    floor = cost.floor(ceiling, queue)
    one = await drain(cluster, receiver, plan, logs, backlog=plan.drain_backlog, path="/drain")
    two = await drain(
        cluster, receiver, plan, logs, backlog=plan.drain_backlog, path="/drain", processes=2
    )
    adaptive = await drain(
        cluster, receiver, plan, logs, backlog=plan.drain_backlog, path="/drain",
        concurrency="adaptive",
    )  # fmt: skip
    slot_rate = slots / plan.drain_latency
    ratios = {
        "slow_share_of_slots": round(slow["deliveries_per_s"] / slot_rate, 3),
        "instant_share_of_ceiling": round(
            one["deliveries_per_s"] / max(ceiling["requests_per_s"], 1), 3
        ),
        "two_over_one": round(two["deliveries_per_s"] / max(one["deliveries_per_s"], 1), 3),
    }
    return {
        "slow": {**slow, "latency_ms": latency_ms, "slots": slots, "slots_per_latency": slot_rate},
        "ceiling": ceiling,
        "instant_1": one,
        "instant_2": two,
        # Issue 26's cost rows with the default endpoint (adaptive): not in the ratios,
        # which compare like with like (fixed slots, as the ceiling's concurrency).
        "instant_adaptive": adaptive,
        "ratios": ratios,
        "floor": floor,
        "targets": TARGETS,
        "verdicts": {name: ratios[name] >= goal for name, goal in TARGETS.items()},
    }
