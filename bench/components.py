"""One part at a time: the relay alone, claim and complete without HTTP, transports, RSS,
publish() per event with and without an idempotency key."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from sqlalchemy import create_engine, text

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
from delivery.http import AttemptResult, build_http_client
from delivery.policy import Outcome
from delivery.worker import ClaimedDelivery, Worker, WorkerConfig
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import libpq_url, make_async_engine, sqlalchemy_url
from outbox.endpoints import create_endpoint
from outbox.relay import Relay, RelayConfig


def _preload_events(
    url: str,
    count: int,
    fanout: int,
    endpoint_url: str,
    box: SecretBox | None = None,
    concurrency: str = "fixed",
) -> None:
    box = box or SecretBox.from_setting(generate_key("bench"))
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        for _ in range(fanout):
            create_endpoint(conn, box, url=endpoint_url, event_types="*", concurrency=concurrency)
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_bench_' || g, (SELECT id FROM tenants WHERE uid = 'default'),
                       :event_type, CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {"event_type": EVENT_TYPE, "payload": json.dumps(PAYLOAD), "count": count},
        )
    _vacuum(url)
    engine.dispose()


def _vacuum(url: str) -> None:
    engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()


async def relay_alone(cluster: Cluster, plan: Plan, batch_size: int, fanout: int) -> dict[str, Any]:
    database = cluster.new_database("relay")
    url = cluster.database_url(database)
    _preload_events(url, plan.relay_events, fanout, "http://127.0.0.1:9/unused")
    commits_before, wal_before = cluster.counters(database)
    engine = make_async_engine(url, pool_pre_ping=False)
    relay = Relay(engine, SystemClock(), RelayConfig(batch_size=batch_size))
    began = time.perf_counter()
    done = await relay.run_until_idle()
    elapsed = time.perf_counter() - began
    await engine.dispose()
    commits_after, wal_after = cluster.counters(database)
    return {
        "events": done.events,
        "deliveries": done.deliveries,
        "fanout": fanout,
        "batch_size": batch_size,
        "seconds": round(elapsed, 2),
        "events_per_s": round(done.events / elapsed),
        "delivery_rows_per_s": round(done.deliveries / elapsed),
        "commits": commits_after - commits_before,
        "wal_bytes_per_delivery": round((wal_after - wal_before) / max(done.deliveries, 1)),
    }


def _succeeded(claimed: ClaimedDelivery, now: Any) -> AttemptResult:
    return AttemptResult(
        delivery_id=claimed.id,
        started_at=now,
        duration_ms=1,
        outcome=Outcome.SUCCEEDED,
        status_code=200,
        response_excerpt="",
        request_headers={"webhook-id": claimed.request.message_id},
    )


async def claim_and_complete(
    cluster: Cluster, plan: Plan, batch_size: int, processes: int = 1
) -> dict[str, Any]:
    """The worker's own claim and record paths, with the HTTP attempt replaced by success.

    With `processes` > 1 the loops run in that many spawned processes (each with
    `plan.claim_loops` loops), the way `outbox run --processes N` would; the rate is
    taken from the first loop's start to the last loop's end, across processes.
    """
    database = cluster.new_database("claim")
    url = cluster.database_url(database)
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    _preload_events(url, plan.claim_deliveries, 1, "http://127.0.0.1:9/unused", box)
    engine = make_async_engine(url, pool_pre_ping=False)
    await Relay(engine, SystemClock(), RelayConfig(batch_size=2000)).run_until_idle()
    await engine.dispose()
    _vacuum(url)
    commits_before, wal_before = cluster.counters(database)
    if processes == 1:
        spans = [await claim_loops(url, key_setting, batch_size, plan.claim_loops, "bench.0")]
    else:
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            spans = await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool,
                        _claim_loops_in_process,
                        url,
                        key_setting,
                        batch_size,
                        plan.claim_loops,
                        f"bench.{index}",
                    )
                    for index in range(processes)
                )
            )
    done = sum(count for count, _, _ in spans)
    elapsed = max(end for _, _, end in spans) - min(start for _, start, _ in spans)
    commits_after, wal_after = cluster.counters(database)
    return {
        "deliveries": done,
        "batch_size": batch_size,
        "processes": processes,
        "concurrent_loops": plan.claim_loops,
        "seconds": round(elapsed, 2),
        "deliveries_per_s": round(done / elapsed),
        "commits_per_delivery": round((commits_after - commits_before) / max(done, 1), 4),
        "wal_bytes_per_delivery": round((wal_after - wal_before) / max(done, 1)),
    }


def _claim_loops_in_process(
    url: str, key_setting: str, batch_size: int, loops: int, worker_id: str
) -> tuple[int, float, float]:
    return asyncio.run(claim_loops(url, key_setting, batch_size, loops, worker_id))


async def claim_loops(
    url: str, key_setting: str, batch_size: int, loops: int, worker_id: str
) -> tuple[int, float, float]:
    """Claim and record until nothing is due; returns (succeeded, start, end) wall times."""
    engine = make_async_engine(url, pool_size=loops + 1, pool_pre_ping=False)
    clock = SystemClock()
    worker = Worker(
        engine,
        httpx.AsyncClient(),  # never used: the attempt is replaced by a success
        SecretBox.from_setting(key_setting),
        clock,
        WorkerConfig(worker_id=worker_id, batch_size=batch_size),
    )
    done = 0

    async def loop() -> None:
        nonlocal done
        while True:
            claimed = await worker.claim(batch_size)
            if not claimed:
                return
            now = clock.now()
            stats = await worker.record([(c, _succeeded(c, now)) for c in claimed])
            done += stats.succeeded

    async with engine.connect():  # open the pool before the clock starts
        pass
    began = time.time()
    await asyncio.gather(*(loop() for _ in range(loops)))
    ended = time.time()
    await engine.dispose()
    return done, began, ended


async def transports(receiver: ReceiverProcess, plan: Plan) -> dict[str, Any]:
    """Requests/s from this process to the receiver through each wire, 10 and 100 concurrent."""
    results: dict[str, Any] = {}
    for concurrency in (10, 100):
        for name in ("httpx", "wire"):
            results[f"{name}_{concurrency}"] = await _requests_per_s(
                receiver.url("/transport"), name, concurrency, plan.transport_seconds
            )
        results[f"wire_over_httpx_{concurrency}"] = round(
            results[f"wire_{concurrency}"] / max(results[f"httpx_{concurrency}"], 1), 1
        )
    return results


async def _requests_per_s(url: str, transport: str, concurrency: int, seconds: float) -> int:
    async with build_http_client(
        max_connections=100, timeout=10, transport=transport, allowed_networks=(LOOPBACK,)
    ) as client:
        await asyncio.gather(*(client.post(url, content=b"{}") for _ in range(concurrency)))
        done = 0
        stop_at = time.perf_counter() + seconds

        async def one() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                response = await client.post(url, content=b'{"a":1}')
                response.raise_for_status()
                done += 1

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return round(done / (time.perf_counter() - began))


async def rss_in_flight(
    cluster: Cluster, receiver: ReceiverProcess, plan: Plan, logs: Path
) -> dict[str, Any]:
    """Worker peak RSS with `rss_in_flight` deliveries held open by a slow receiver."""
    database = cluster.new_database("rss")
    url = cluster.database_url(database)
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        create_endpoint(
            conn,
            box,
            url=receiver.url(f"/slow/{database}"),
            event_types="*",
            concurrency="fixed",
        )
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_rss_' || g, (SELECT id FROM tenants WHERE uid = 'default'),
                       :event_type, CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {
                "event_type": EVENT_TYPE,
                "payload": json.dumps(PAYLOAD),
                "count": 2 * plan.rss_in_flight,
            },
        )
    workers = WorkerProcesses(
        ours_commands(1),
        {
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_SECRET_KEYS": key_setting,
            "OUTBOX_WORKER_MAX_IN_FLIGHT": str(plan.rss_in_flight),
            "OUTBOX_ALLOWED_NETWORKS": LOOPBACK,
            "OUTBOX_WORKER_BATCH_SIZE": str(min(500, plan.rss_in_flight)),
            "OUTBOX_REQUEST_TIMEOUT": str(plan.slow_delay * 3),
            "OUTBOX_LEASE_SECONDS": str(plan.slow_delay * 10),
            # One endpoint here, and by default one endpoint may hold only half the
            # worker's slots (endpoint health): let it hold them all for this figure.
            "OUTBOX_WORKER_ENDPOINT_SHARE": "1",
        },
        logs / f"{database}.log",
    )
    workers.start()
    most = 0
    try:
        deadline = time.time() + plan.slow_delay * 3 + 20
        while time.time() < deadline:
            with engine.connect() as conn:
                in_flight = conn.execute(
                    text("SELECT count(*) FROM deliveries WHERE state = 'in_flight'")
                ).scalar_one()
            most = max(most, int(in_flight))
            if most >= plan.rss_in_flight:
                await asyncio.sleep(plan.slow_delay / 2)
                break
            await asyncio.sleep(0.1)
        peak = workers.peak_rss_mb()
    finally:
        workers.stop()
        engine.dispose()
    return {"in_flight": most, "max_in_flight": plan.rss_in_flight, "worker_peak_rss_mb": peak}


# -- publish() per event, with and without an idempotency key ------------------------------

# A keyed event is stored with the sha256 of its canonical payload (PostgreSQL's jsonb text)
# so that a reused key can be compared with its first input (issue 24); an unkeyed one is
# not hashed. The rows below show what the key costs: "new key" (hash, the unique index),
# "same key again" (the retry of an operation: nothing written, the stored hash compared).
PUBLISH_VARIANTS = ("no key", "new key", "same key again")
PUBLISH_TRANSACTION = 100  # events per application transaction
BIG_PAYLOAD = {"order_id": 123456, "lines": [{"sku": f"sku_{n:05d}", "qty": n} for n in range(500)]}


def _publish_events(url: str, payload: dict[str, Any], keys: list[str | None]) -> float:
    """Wall seconds to publish one event per key, PUBLISH_TRANSACTION per transaction."""
    from outbox.publish import publish

    with psycopg.connect(libpq_url(url)) as conn:
        began = time.perf_counter()
        for start in range(0, len(keys), PUBLISH_TRANSACTION):
            with conn.transaction():
                for key in keys[start : start + PUBLISH_TRANSACTION]:
                    publish(conn, EVENT_TYPE, payload, idempotency_key=key)
        return time.perf_counter() - began


def _hash_alone_us(url: str, payload: dict[str, Any], count: int) -> float:
    """The server's canonical text + sha256 of one payload, in µs: the same expression as
    publish's (outbox/sql/events.py), less the same rows without it. Each row's payload
    differs (one more key) so that nothing is computed once and reused."""
    rows = "(CAST(:p AS jsonb) || jsonb_build_object('g', g))"
    timed = {
        "hashed": f"SELECT count(sha256(convert_to(CAST({rows} AS text), 'UTF8')))",
        "plain": f"SELECT count({rows})",
    }
    best: dict[str, float] = {}
    engine = create_engine(sqlalchemy_url(url))
    with engine.connect() as conn:
        for _ in range(3):
            for name, select in timed.items():
                began = time.perf_counter()
                conn.execute(
                    text(select + " FROM generate_series(1, :n) g"),  # noqa: S608 - constants
                    {"p": json.dumps(payload), "n": count},
                )
                elapsed = time.perf_counter() - began
                best[name] = min(best.get(name, elapsed), elapsed)
    engine.dispose()
    return max(best["hashed"] - best["plain"], 0.0) / count * 1e6


def publish_cost(cluster: Cluster, plan: Plan) -> dict[str, Any]:
    """publish() per event on a psycopg connection (the application's fastest path), for a
    small and a 15 KB payload, each variant in `plan.publish_rounds` alternating rounds; the
    median round of each. CPU is this process's (the application's side); the server's
    hashing shows in the wall time and, alone, in `hash_alone_us`."""
    url = cluster.database_url(cluster.new_database("publish"))
    count = plan.publish_events
    warm_count = min(count, PUBLISH_TRANSACTION)
    results: dict[str, Any] = {
        "events": count,
        "rounds": plan.publish_rounds,
        "per_transaction": PUBLISH_TRANSACTION,
    }
    for label, payload in (("small", PAYLOAD), ("large", BIG_PAYLOAD)):
        size = len(json.dumps(payload, separators=(",", ":")).encode())
        warm: list[str | None] = [f"{label}-warm-{n}" for n in range(warm_count)]
        unkeyed: list[str | None] = [None] * warm_count
        for keys in (unkeyed, warm, warm):  # caches, plans, TOAST
            _publish_events(url, payload, keys)
        walls: dict[str, list[float]] = {variant: [] for variant in PUBLISH_VARIANTS}
        for round_ in range(plan.publish_rounds):
            keyed: list[str | None] = [f"{label}-{round_}-{n}" for n in range(count)]
            unkeyed_first = round_ % 2 == 0  # so neither side always runs on a fresher table
            if unkeyed_first:
                walls["no key"].append(_publish_events(url, payload, [None] * count))
            walls["new key"].append(_publish_events(url, payload, keyed))
            walls["same key again"].append(_publish_events(url, payload, keyed))
            if not unkeyed_first:
                walls["no key"].append(_publish_events(url, payload, [None] * count))
        results[label] = {
            "payload_bytes": size,
            "us_per_event": {
                variant: round(sorted(times)[len(times) // 2] / count * 1e6, 1)
                for variant, times in walls.items()
            },
            "rounds_us_per_event": {  # the spread the median hides
                variant: [round(t / count * 1e6, 1) for t in times]
                for variant, times in walls.items()
            },
            "hash_alone_us": round(_hash_alone_us(url, payload, 10 * count), 2),
        }
    # What was written: every unkeyed and new-keyed event; a key published again, nothing.
    engine = create_engine(sqlalchemy_url(url))
    with engine.connect() as conn:
        results["rows"] = conn.execute(text("SELECT count(*) FROM outbox_events")).scalar_one()
    engine.dispose()
    results["rows_expected"] = 2 * (2 * warm_count + 2 * count * plan.publish_rounds)
    return results


def publish_report(publish: dict[str, Any]) -> str:
    """One line: µs per published event by payload and key, and the hash alone."""
    parts = []
    for label in ("small", "large"):
        row = publish[label]
        per = row["us_per_event"]
        parts.append(
            f"{row['payload_bytes']} B payload: no key {per['no key']:g}, new key "
            f"{per['new key']:g}, same key again {per['same key again']:g} "
            f"(hash alone {row['hash_alone_us']:g})"
        )
    return (
        f"publish() µs per event ({publish['events']} events, {publish['per_transaction']} a "
        f"transaction, median of {publish['rounds']} rounds): " + "; ".join(parts)
    )
