"""What an upgrade costs the running system (issue 23): stalls while `outbox migrate` runs.

The previous release (PREVIOUS_RELEASE, run from its own files: tools/previous_release.py)
migrates a fresh database to its schema; `history` delivered events (one succeeded
delivery and one attempt each) are added in SQL, as retention would find them. Then,
all from the previous release: one `outbox run` process delivers to a receiver on
loopback while a publisher commits `rate` events a second, one per transaction. Once
the worker delivers, and `warmup` seconds more, this release's `outbox migrate` runs;
`cooldown` seconds later everything stops.

Two figures over the migration's window, each against the same figure before it:
the longest publish (one `publish()` plus its commit, as the application sees it) and
the longest gap between two deliveries arriving at the receiver. Target: each at most
1 s. For contrast, the same two index builds are then done the way 0019 did them (drop,
CREATE INDEX, in one transaction), and the same figures taken over that window.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.cluster import EVENT_TYPE, PAYLOAD, machine
from bench.components import _vacuum
from bench.flat import _HISTORY
from delivery.receiver import Receiver
from outbox.crypto import generate_key
from outbox.db import sqlalchemy_url
from outbox.embedded import EmbeddedPostgres
from tools import previous_release
from tools.previous_release import OUTBOX, ROOT

TARGET_SECONDS = 1.0

# The previous release's publish(), paced at argv[2] events/s: one line per commit,
# "<start unix time> <seconds publish+commit took>".
PUBLISHER = """
import signal, sys, time
from outbox import publish
from outbox.db import make_engine

stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
engine = make_engine(sys.argv[1])
interval = 1 / float(sys.argv[2])
next_at = time.perf_counter()
i = 0
while not stopping:
    started_wall, started = time.time(), time.perf_counter()
    with engine.begin() as conn:
        publish(conn, "bench.event", {"i": i})
    print(f"{started_wall:.6f} {time.perf_counter() - started:.6f}", flush=True)
    i += 1
    next_at += interval
    time.sleep(max(0.0, next_at - time.perf_counter()))
"""


@dataclass(frozen=True, slots=True)
class StallPlan:
    history: int = 1_000_000
    rate: int = 200
    warmup: float = 10.0
    cooldown: float = 5.0

    @classmethod
    def quick(cls) -> StallPlan:
        return cls(history=5_000, rate=50, warmup=3.0, cooldown=2.0)


def measure(plan: StallPlan, progress: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="outbox-bench-migrate-") as root:
        server = EmbeddedPostgres(Path(root) / "pg", delete_on_stop=True)
        url = server.start()
        try:
            old = previous_release.checkout(Path(tempfile.mkdtemp(dir=root)))
            results = asyncio.run(_measure(plan, url, old, Path(root), progress))
        finally:
            server.stop()
    results["machine"] = machine()
    results["plan"] = asdict(plan)
    results["previous_release"] = previous_release.commit()
    return results


async def _run(release: Path, env: dict[str, str], *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *OUTBOX,
        *args,
        cwd=release,
        env=previous_release.env(release, env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"outbox {' '.join(args)} failed: {output.decode()}")
    return output.decode()


def _fill_history(url: str, history: int) -> float:
    began = time.perf_counter()
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        ids = conn.execute(text("SELECT id, tenant_id FROM endpoints")).one()
    params = {
        "endpoint": ids.id,
        "tenant": ids.tenant_id,
        "event_type": EVENT_TYPE,
        "payload": json.dumps(PAYLOAD),
        "history": history,
    }
    for statement in _HISTORY:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    engine.dispose()
    _vacuum(url)
    return time.perf_counter() - began


# What 0019 did before 0.2.0, on the same indexes: drop and build again in one
# transaction. DROP INDEX locks the whole table; CREATE INDEX blocks its writers.
_BLOCKING_REBUILD = [
    "DROP INDEX ix_deliveries_due_ranked",
    "CREATE INDEX ix_deliveries_due_ranked ON deliveries (priority DESC, next_attempt_at, id)"
    " WHERE state = 'scheduled'",
    "DROP INDEX ix_deliveries_due_per_endpoint_ranked",
    "CREATE INDEX ix_deliveries_due_per_endpoint_ranked ON deliveries"
    " (endpoint_id, priority DESC, next_attempt_at, id) WHERE state = 'scheduled'",
]


def _rebuild_blocking(url: str) -> None:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            for statement in _BLOCKING_REBUILD:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def _delivering(worker_log: Path, receiver: Receiver, at_least: int) -> bool:
    return "outbox running" in worker_log.read_text() and len(receiver.requests) >= at_least


def _longest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The longest time without a delivery anywhere in [start, end]."""
    inside = [start, *(t for t in arrivals if start < t < end), end]
    before = [t for t in arrivals if t <= start]
    after = [t for t in arrivals if t >= end]
    # A gap that spans a window edge counts whole: it is what a partner saw.
    if before:
        inside[0] = before[-1]
    if after:
        inside[-1] = after[0]
    return max(b - a for a, b in itertools.pairwise(inside))


async def _measure(
    plan: StallPlan, url: str, old: Path, root: Path, progress: Any
) -> dict[str, Any]:
    env = previous_release.base_env(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_SECRET_KEYS=generate_key("bench"),
        OUTBOX_ALLOWED_NETWORKS="127.0.0.0/8",
        OUTBOX_PROCESSES="1",
        OUTBOX_LOG_SUMMARY_INTERVAL="0",
    )
    async with Receiver() as receiver:
        progress("previous release: migrate, add an endpoint")
        await _run(old, env, "migrate")
        await _run(old, env, "endpoints", "add", receiver.route("/hooks"), "--events", "*")
        progress(f"{plan.history:,} delivered events of history")
        build_seconds = _fill_history(url, plan.history)
        progress(f"previous release: `outbox run` and a publisher at {plan.rate}/s")
        publish_log = root / "publisher.out"
        with publish_log.open("wb") as out, (root / "publisher.err").open("wb") as err:
            publisher = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                PUBLISHER,
                url,
                str(plan.rate),
                cwd=old,
                env=previous_release.env(old, env),
                stdout=out,
                stderr=err,
            )
        with (root / "worker.err").open("wb") as err:
            worker = await asyncio.create_subprocess_exec(
                *OUTBOX,
                "run",
                cwd=old,
                env=previous_release.env(old, env),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=err,
            )
        try:
            async with asyncio.timeout(120):
                # Polls what other processes write: a log file and the receiver's list.
                while not _delivering(root / "worker.err", receiver, plan.rate):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
            warm_start = time.time()
            await asyncio.sleep(plan.warmup)
            progress("this release: outbox migrate")
            window_start = time.time()
            migrated = await _run(ROOT, env, "migrate")
            window_end = time.time()
            await asyncio.sleep(plan.cooldown)
            progress("for contrast: the same index builds done the old way (0019's)")
            blocking_start = time.time()
            await asyncio.to_thread(_rebuild_blocking, url)
            blocking_end = time.time()
            await asyncio.sleep(plan.cooldown)
        finally:
            for process in (publisher, worker):
                process.send_signal(signal.SIGTERM)
            for process in (publisher, worker):
                await asyncio.wait_for(process.wait(), timeout=60)
        publishes = [
            (float(start), float(took))
            for start, took in (line.split() for line in publish_log.read_text().splitlines())
        ]
        arrivals = sorted(r.received_at for r in receiver.requests)

    def longest_publish(start: float, end: float) -> float:
        """Of the publishes that overlap [start, end] (one stuck across an edge counts)."""
        overlapping = (took for at, took in publishes if at <= end and at + took >= start)
        return round(max(overlapping, default=0.0), 4)

    during = [took for start, took in publishes if window_start <= start <= window_end]
    errors = [
        line
        for name in ("publisher.err", "worker.err")
        for line in (root / name).read_text().splitlines()
        if " ERROR " in line or "Traceback" in line
    ]
    return {
        "history_rows": plan.history,
        "history_build_seconds": round(build_seconds, 1),
        "publish_rate": plan.rate,
        "migration_seconds": round(window_end - window_start, 2),
        "migration_output": migrated.splitlines(),
        "published": len(publishes),
        "delivered": len(arrivals),
        "published_during_migration": len(during),
        "delivered_during_migration": sum(window_start <= t <= window_end for t in arrivals),
        "longest_publish_s": {
            "during_migration": longest_publish(window_start, window_end),
            "before": longest_publish(warm_start, window_start),
            "blocking_counterpart": longest_publish(blocking_start, blocking_end),
        },
        "longest_delivery_gap_s": {
            "during_migration": round(_longest_gap(arrivals, window_start, window_end), 4),
            "before": round(_longest_gap(arrivals, warm_start, window_start), 4),
            "blocking_counterpart": round(_longest_gap(arrivals, blocking_start, blocking_end), 4),
        },
        "blocking_counterpart_seconds": round(blocking_end - blocking_start, 2),
        "target_s": TARGET_SECONDS,
        "errors_logged": errors,
    }


def report(results: dict[str, Any]) -> list[str]:
    publish, gap = results["longest_publish_s"], results["longest_delivery_gap_s"]

    def verdict(value: float) -> str:
        return "met" if value <= TARGET_SECONDS else f"missed ({value:g} s)"

    return [
        f"migration under load (issue 23): previous release -> this one, "
        f"{results['history_rows']:,} delivered events of history, publishing "
        f"{results['publish_rate']}/s; migrate took {results['migration_seconds']} s",
        f"  longest publish: {publish['during_migration']} s during, {publish['before']} s "
        f"before (target <= {TARGET_SECONDS:g} s: {verdict(publish['during_migration'])})",
        f"  longest gap between deliveries: {gap['during_migration']} s during, "
        f"{gap['before']} s before (target <= {TARGET_SECONDS:g} s: "
        f"{verdict(gap['during_migration'])})",
        f"  the same builds done the old way (0019's, blocking) took "
        f"{results['blocking_counterpart_seconds']} s: longest publish "
        f"{publish['blocking_counterpart']} s, longest gap {gap['blocking_counterpart']} s",
        f"  errors logged by the previous release: {len(results['errors_logged'])}",
    ]
