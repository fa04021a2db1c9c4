"""Healthy-endpoint latency, alone and next to three misbehaving partners.

    python bench/health_latency.py [--seconds 15] [--rate 100] [--database-url URL]

Runs the real service (relay + worker + reaper, LISTEN/NOTIFY) against an embedded
PostgreSQL (or --database-url / OUTBOX_DATABASE_URL, whose outbox tables it empties)
and a receiver on 127.0.0.1. A publisher commits `rate` events per second for
`seconds`; every event goes to every endpoint. Latency is from the publishing
transaction's commit to the request's arrival at the healthy partner.

Scenarios:
  alone        only the healthy partner
  misbehaving  plus one down (connection refused), one hanging past the deadline and
               one answering 429 with Retry-After: 5, with the default breaker
  no-breaker   the same, with the breaker thresholds set out of reach (for contrast)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, text

from delivery.health import HealthConfig
from delivery.operator.app import Service
from delivery.reaper import ReaperConfig
from delivery.receiver import Receiver
from delivery.worker import WorkerConfig
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_engine
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import create_endpoint
from outbox.migrate import upgrade
from outbox.publish import publish
from outbox.relay import RelayConfig

TABLES = (
    "outbox_events, endpoints, deliveries, delivery_attempts, audit_log, endpoint_health,"
    " event_type_priorities"
)
REQUEST_TIMEOUT = 5.0
SETTLED_AFTER = 2 * REQUEST_TIMEOUT  # seconds into the run


@dataclass
class Result:
    scenario: str
    published: int
    delivered: int
    p50_ms: float
    p99_ms: float
    p99_settled_ms: float | None
    max_ms: float
    others: str


def refused_port() -> int:
    """A loopback port nobody listens on: connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def publish_steadily(url: str, seconds: float, rate: float) -> list[float]:
    """Commit `rate` events per second for `seconds`, one transaction each.

    Returns when each event's commit returned (time.time()), indexed by its "n".
    """
    engine = make_engine(url)
    committed_at: list[float] = []
    started = time.perf_counter()
    try:
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(max(0, int(elapsed * rate) + 1 - len(committed_at))):
                with engine.begin() as conn:
                    publish(conn, "order.created", {"n": len(committed_at)})
                # The commit returned: from now on the event exists for the world.
                committed_at.append(time.time())
            time.sleep(0.002)
    finally:
        engine.dispose()
    return committed_at


async def run_scenario(
    url: str, engine: Engine, scenario: str, seconds: float, rate: float
) -> Result:
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    box = SecretBox.from_setting(generate_key("bench"))
    async with Receiver() as receiver:
        targets = {"healthy": receiver.route("/healthy")}
        if scenario != "alone":
            targets["down"] = f"http://127.0.0.1:{refused_port()}/down"
            targets["hanging"] = receiver.route("/hanging", delay=3600)
            targets["throttled"] = receiver.route(
                "/throttled", status=429, headers={"Retry-After": "5"}
            )
        uids = {}
        with engine.begin() as conn:
            for name, target in targets.items():
                uids[name] = create_endpoint(
                    conn, box, url=target, event_types="*", concurrency="fixed"
                ).endpoint.uid
        health = HealthConfig(probe_lease_seconds=60.0)
        if scenario == "no-breaker":
            health = HealthConfig(failure_threshold=10**9, ratio_min_attempts=10**9)
        service = Service(
            url,
            box,
            relay=RelayConfig(batch_size=500, poll_interval=0.5),
            worker=WorkerConfig(
                batch_size=100,
                max_in_flight=200,
                poll_interval=0.5,
                request_timeout=REQUEST_TIMEOUT,
                retry_schedule=(1.0, 5.0, 30.0),
                health=health,
            ),
            reaper=ReaperConfig(interval=1.0),
            allowed_networks=("127.0.0.0/8",),
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(service.run(stop))
        # The publisher is a separate process, like the application would be, so
        # publishing neither waits for the service's event loop nor competes for its GIL.
        with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            future = pool.submit(publish_steadily, url, seconds, rate)
            committed_at = await asyncio.wrap_future(future)
        published = len(committed_at)
        try:
            deadline = time.perf_counter() + 30
            while len(receiver.received("/healthy")) < published:
                if time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await runner
        latencies, settled = [], []
        first = committed_at[0] if committed_at else 0.0
        for request in receiver.received("/healthy"):
            n = int(request.body.split(b'"n":')[1].split(b"}")[0])
            latency = (request.received_at - committed_at[n]) * 1000
            latencies.append(latency)
            # Events published once the first deadline could have tripped the breakers.
            if committed_at[n] - first >= SETTLED_AFTER:
                settled.append(latency)
        with engine.connect() as conn:
            attempts: dict[str, int] = dict(
                conn.execute(
                    text(
                        "SELECT e.uid, count(a.id) FROM endpoints e"
                        " LEFT JOIN deliveries d ON d.endpoint_id = e.id"
                        " LEFT JOIN delivery_attempts a ON a.delivery_id = d.id GROUP BY e.uid"
                    )
                ).all()
            )
        others = ", ".join(
            f"{name}: {attempts.get(uid, 0)} attempts"
            for name, uid in uids.items()
            if name != "healthy"
        )
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    later = statistics.quantiles(settled, n=100) if len(settled) > 1 else None
    return Result(
        scenario,
        published,
        len(latencies),
        quantiles[49],
        quantiles[98],
        later[98] if later else None,
        max(latencies, default=0.0),
        others or "-",
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rate", type=float, default=100.0, help="events per second")
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DATABASE_URL"))
    parser.add_argument(
        "--scenarios", default="alone,misbehaving,no-breaker", help="comma-separated"
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.database_url
        if not url:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-bench-"))
            url = stack.enter_context(EmbeddedPostgres(Path(tmp), delete_on_stop=True)).url()
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        results = []
        for scenario in args.scenarios.split(","):
            print(
                f"running {scenario} for {args.seconds:g}s at {args.rate:g}/s ...", file=sys.stderr
            )
            results.append(await run_scenario(url, engine, scenario, args.seconds, args.rate))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{args.rate:g} events/s for {args.seconds:g}s, deadline {REQUEST_TIMEOUT:g}s;"
        f" {os.cpu_count()} CPUs, load average after the run {load}\n"
    )
    print(
        "| scenario | published | delivered to healthy | p50 ms | p99 ms"
        f" | p99 ms after {SETTLED_AFTER:g} s | max ms | others |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.scenario} | {r.published} | {r.delivered} | {r.p50_ms:.1f} | {r.p99_ms:.1f}"
            f" | {'-' if r.p99_settled_ms is None else f'{r.p99_settled_ms:.1f}'}"
            f" | {r.max_ms:.1f} | {r.others} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
