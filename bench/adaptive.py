"""Adaptive concurrency against fixed in-flight limits (issue 25, item 3).

One receiver on 127.0.0.1 stands for a partner of capacity N: up to N concurrent
requests it answers in `base` seconds, above that its latency grows in proportion
(base * concurrent / N: its throughput is flat at N / base), and above 2N it answers
429 at once (no Retry-After). Each row runs the real service (relay + worker) against
one endpoint with a backlog, with a fixed limit (1, N/2, N, 2N, 4N) or adaptive with
ceiling 4N, once per limiter (AIMD, gradient: delivery/health/adaptive.py), all against
the same partner in one run. Throughput (2xx per second) and the share of 429 count
after the first 10 s. In the adaptive rows the receiver's capacity doubles mid-run;
recovery is the time from then until a one-second window reaches 90 % of the doubled
capacity (2N / base).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from delivery.health import EndpointLimits, HealthConfig, set_endpoint_limits
from delivery.health.adaptive import ALGORITHMS, AdaptiveConfig, Algorithm
from delivery.operator.app import Service
from delivery.reaper import ReaperConfig
from delivery.receiver import Behaviour, ReceivedRequest, Receiver
from delivery.worker import WorkerConfig
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_engine
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import create_endpoint
from outbox.migrate import upgrade
from outbox.publish import publish
from outbox.relay import RelayConfig

TABLES = "outbox_events, endpoints, deliveries, delivery_attempts, audit_log, endpoint_health"
WARMUP = 10.0  # seconds: throughput and 429 share count after this


@dataclass(frozen=True, slots=True)
class AdaptivePlan:
    capacity: int = 8  # N
    base_seconds: float = 0.2  # the partner's unloaded latency
    row_seconds: float = 16.0  # each fixed row
    double_at: float = 16.0  # the adaptive row: capacity doubles then ...
    adaptive_seconds: float = 30.0  # ... and the row ends then

    @classmethod
    def quick(cls) -> AdaptivePlan:
        return cls(row_seconds=12.0, double_at=12.0, adaptive_seconds=24.0)


class Partner:
    """The receiver's behaviour: latency grows past `capacity` concurrent, 429 past twice it."""

    def __init__(self, capacity: int, base: float) -> None:
        self.capacity, self.base, self.current = capacity, base, 0
        self.answers: list[tuple[float, int]] = []  # (monotonic time, status)

    async def __call__(self, _: ReceivedRequest) -> Behaviour:
        self.current += 1
        try:
            if self.current > 2 * self.capacity:
                status = 429
            else:
                await asyncio.sleep(self.base * max(1.0, self.current / self.capacity))
                status = 200
            self.answers.append((time.monotonic(), status))
            return Behaviour(status=status)
        finally:
            self.current -= 1


def _rate(answers: list[tuple[float, int]], start: float, end: float) -> tuple[float, float]:
    """2xx per second and the share of 429 among answers in [start, end)."""
    window = [status for at, status in answers if start <= at < end]
    ok = sum(1 for s in window if s < 300)
    throttled = sum(1 for s in window if s == 429)
    return ok / max(end - start, 1e-9), throttled / len(window) if window else 0.0


async def _sample(
    engine: Engine, partner: Partner, started: float, trace: list[tuple[float, int | None, int]]
) -> None:
    """Every half second: the adaptive limit in the database and the partner's concurrency."""
    while True:
        with engine.connect() as conn:
            limit = conn.execute(text("SELECT adaptive_limit FROM endpoint_health")).scalar()
        trace.append((round(time.monotonic() - started, 1), limit, partner.current))
        await asyncio.sleep(0.5)


async def _row(
    url: str,
    engine: Engine,
    plan: AdaptivePlan,
    name: str,
    limit: int,
    algorithm: Algorithm | None,
) -> dict[str, Any]:
    """One row: a fixed limit (algorithm None) or adaptive with that limiter."""
    adaptive = algorithm is not None
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    box = SecretBox.from_setting(generate_key("bench"))
    seconds = plan.adaptive_seconds if adaptive else plan.row_seconds
    peak_rate = 2 * plan.capacity / plan.base_seconds
    backlog = int(peak_rate * seconds * 1.3) + 100
    partner = Partner(plan.capacity, plan.base_seconds)
    async with Receiver() as receiver:
        with engine.begin() as conn:
            uid = create_endpoint(
                conn, box, url=receiver.route("/partner", partner), event_types="*"
            ).endpoint.uid
            set_endpoint_limits(
                conn,
                uid,
                EndpointLimits(max_in_flight=limit, adaptive=adaptive),
                actor="bench",
            )
            for n in range(backlog):
                publish(conn, "order.created", {"n": n})
        service = Service(
            url,
            box,
            relay=RelayConfig(batch_size=1000, poll_interval=0.2),
            worker=WorkerConfig(
                batch_size=20,
                max_in_flight=200,
                poll_interval=0.05,
                request_timeout=5.0,
                retry_schedule=(1.0,),
                health=HealthConfig(
                    # a fixed row never consults the limiter: any algorithm will do
                    adaptive=AdaptiveConfig(algorithm=algorithm or "gradient")
                ),
            ),
            reaper=ReaperConfig(interval=1.0),
            allowed_networks=("127.0.0.0/8",),
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(service.run(stop))
        started = time.monotonic()
        trace: list[tuple[float, int | None, int]] = []
        sampler = asyncio.create_task(_sample(engine, partner, started, trace))
        try:
            if adaptive:
                await asyncio.sleep(plan.double_at)
                partner.capacity *= 2
            await asyncio.sleep(seconds - (time.monotonic() - started))
        finally:
            sampler.cancel()
            stop.set()
            await runner
        ended = time.monotonic()
    answers = partner.answers
    measured_end = started + plan.double_at if adaptive else ended
    throughput, throttled = _rate(answers, started + WARMUP, measured_end)
    row: dict[str, Any] = {
        "row": name,
        "algorithm": algorithm,
        "limit": limit,
        "throughput": throughput,
        "share_429": throttled,
        "recovery_s": None,
        "trace": trace,  # (seconds, adaptive limit, concurrent requests at the partner)
    }
    if adaptive:
        doubled = started + plan.double_at
        target = 0.9 * peak_rate
        t = doubled
        while t + 1.0 <= ended:
            if _rate(answers, t, t + 1.0)[0] >= target:
                row["recovery_s"] = t + 1.0 - doubled
                break
            t += 0.1
        after_rate, after_429 = _rate(answers, doubled + 10.0, ended)
        row["after_doubling"] = {"throughput": after_rate, "share_429": after_429}
    return row


async def _measure(
    plan: AdaptivePlan, progress: Callable[[str], None], fixed: bool = True
) -> dict[str, Any]:
    n = plan.capacity
    rows = [("fixed 1", 1), ("fixed N/2", n // 2), ("fixed N", n), ("fixed 2N", 2 * n)]
    rows.append(("fixed 4N", 4 * n))
    if not fixed:
        rows = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-bench-"))
        url = stack.enter_context(EmbeddedPostgres(Path(tmp), delete_on_stop=True)).url()
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine)
        results = []
        for name, limit in rows:
            progress(f"adaptive bench: {name} ({limit} in flight)")
            results.append(await _row(url, engine, plan, name, limit, None))
        for algorithm in ALGORITHMS:
            progress(f"adaptive bench: adaptive {algorithm} (ceiling {4 * n}), capacity doubles")
            name = f"adaptive {algorithm}"
            results.append(await _row(url, engine, plan, name, 4 * n, algorithm))
    return {"plan": asdict(plan), "rows": results}


def measure(plan: AdaptivePlan, progress: Callable[[str], None]) -> dict[str, Any]:
    return asyncio.run(_measure(plan, progress))


def _is_adaptive(row: dict[str, Any]) -> bool:
    return str(row["row"]).startswith("adaptive")


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each adaptive row against the issue's three targets (the best fixed row of the run
    is the throughput reference)."""
    fixed = [r for r in results["rows"] if not _is_adaptive(r)]
    best = max(fixed, key=lambda r: r["throughput"])
    found = {}
    for row in filter(_is_adaptive, results["rows"]):
        ratio = row["throughput"] / best["throughput"] if best["throughput"] else 0.0
        recovery = row["recovery_s"]
        found[row["row"]] = {
            "best_fixed": best["row"],
            "ratio": ratio,
            "ratio_met": ratio >= 0.9,
            "share_429": row["share_429"],
            "share_met": row["share_429"] <= 0.01,
            "recovery_s": recovery,
            "recovery_met": recovery is not None and recovery <= 10.0,
        }
    return found


def report(results: dict[str, Any]) -> list[str]:
    """The table, then each of the issue's targets per limiter: met or missed, and by how much."""
    plan = results["plan"]
    lines = [
        f"Partner: N = {plan['capacity']} concurrent at {plan['base_seconds'] * 1000:g} ms "
        f"(flat at {plan['capacity'] / plan['base_seconds']:g}/s past N, 429 past 2N); "
        f"counted after the first {WARMUP:g} s (adaptive: until its capacity doubles "
        f"at {plan['double_at']:g} s)",
        "",
        "| row | limit | 2xx/s | 429 share | recovery after capacity doubles |",
        "|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        recovery, ceiling = "-", str(r["limit"])
        if _is_adaptive(r):
            ceiling = f"adaptive, max {r['limit']}"
            recovery = (
                "not within the run" if r["recovery_s"] is None else f"{r['recovery_s']:.1f} s"
            )
        rate, share = f"{r['throughput']:.1f}", f"{r['share_429']:.2%}"
        lines.append(f"| {r['row']} | {ceiling} | {rate} | {share} | {recovery} |")
    rows = {r["row"]: r for r in results["rows"]}
    for name, v in verdicts(results).items():
        recovery = v["recovery_s"]
        lines += [
            "",
            f"{name}:",
            f"- throughput: {v['ratio']:.2f} of the best fixed ({v['best_fixed']}); "
            "target >= 0.90: " + ("met" if v["ratio_met"] else f"missed by {0.9 - v['ratio']:.2f}"),
            f"- 429 after {WARMUP:g} s: {v['share_429']:.2%}; target <= 1 %: "
            + ("met" if v["share_met"] else "missed"),
            "- recovery after capacity doubles: "
            + (
                "not reached in the run: missed"
                if recovery is None
                else f"{recovery:.1f} s; target <= 10 s: "
                + ("met" if v["recovery_met"] else "missed")
            ),
        ]
        after = rows[name].get("after_doubling")
        if after:
            lines.append(
                f"- after doubling (+10 s to the end): {after['throughput']:.1f} 2xx/s, "
                f"{after['share_429']:.2%} 429"
            )
    return lines
