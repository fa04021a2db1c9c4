"""The benchmark: every figure of issue 7 from one command, on its own database and receiver.

Layout of one run (everything on this host):

    bench process (this one): orchestration, the open-loop producer, relay-alone
        and claim-and-complete measurements, the transport comparison
    receiver process (bench.receiver): raw asyncio HTTP, timestamps arrivals
    worker process(es): `outbox run --processes N`, or bench.pgq_worker for the peer
    PostgreSQL: the embedded server, default (durable) settings, deleted at the end

End to end is open loop: event i is *scheduled* at t0 + i/rate and published by
whichever producer connection is free; latency is taken from the scheduled time to
the receiver's arrival time, so a producer or queue that falls behind shows up in
the latency instead of being hidden by it (no coordinated omission). A step counts
as sustained when the producer kept its schedule, everything published arrived, and
the backlog at the end of the step was at most half a second's worth of deliveries
(at least 50 rows), i.e. the system was not falling behind. Runs of ours and of the
peer alternate, and each is repeated (`Plan.repeat`), because the box is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.cluster import Cluster, Plan, ReceiverProcess, machine
from bench.components import (
    claim_and_complete,
    publish_cost,
    relay_alone,
    rss_in_flight,
    transports,
)
from bench.end_to_end import end_to_end
from outbox.relay import RelayConfig

__all__ = ["Plan", "machine", "ratios", "run", "sustained_median"]


def _as_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _as_json(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


@contextlib.contextmanager
def environment(plan: Plan) -> Iterator[tuple[Cluster, ReceiverProcess, Path]]:
    """A started cluster and bench receiver in a temporary directory, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as root:
        cluster = Cluster(Path(root))
        receiver = ReceiverProcess(plan.slow_delay)
        logs = Path(root) / "logs"
        logs.mkdir()
        try:
            cluster.start()
            receiver.start()
            yield cluster, receiver, logs
        finally:
            receiver.stop()
            cluster.stop()


def run(plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every measurement of the plan; returns the results as plain JSON data."""
    began = time.perf_counter()
    load_before = os.getloadavg()  # how busy the box was: rates depend on it
    with environment(plan) as (cluster, receiver, logs):
        results: dict[str, Any] = asyncio.run(_run(plan, cluster, receiver, logs, progress))
        results["postgres"] = cluster.settings()
    results["machine"] = machine()
    results["plan"] = dataclasses.asdict(plan)
    results["total_seconds"] = round(time.perf_counter() - began, 1)
    results["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    return results


async def _run(
    plan: Plan,
    cluster: Cluster,
    receiver: ReceiverProcess,
    logs: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    results: dict[str, Any] = {"end_to_end": []}
    async with receiver.client():
        if "drain" in plan.sections:
            from bench.drain import drains

            progress("backlog drains: slow partner, instant partner, raw ceiling, 2 processes")
            results["drain"] = await drains(cluster, receiver, plan, logs)
        if "flat" in plan.sections:
            from bench.flat import flat_cost

            progress(
                f"flat cost: {plan.flat_backlog} backlog and {plan.flat_history} history "
                "rows against empty tables"
            )
            results["flat"] = await flat_cost(cluster, plan)
        if "filters" in plan.sections:
            from bench import filters

            filter_plan = filters.FilterPlan.quick() if plan.filters_quick else filters.FilterPlan()
            progress(
                f"relay with payload filters: {filter_plan.endpoints} filtered endpoints "
                f"against {filter_plan.endpoints} unfiltered"
            )
            url = cluster.database_url(cluster.new_database("filters"))
            results["filters"] = await filters.filter_rates(url, filter_plan)
        if "publish" in plan.sections and "core" not in plan.sections:  # (core runs it too)
            progress("publish() per event, with and without an idempotency key")
            results["publish"] = publish_cost(cluster, plan)
        if "cost" in plan.sections:
            progress("cost per delivery: floor, instant drains, open loop (issue 26 alone)")
            results["cost"] = await cost_section(cluster, receiver, plan, logs, progress)
        if "core" not in plan.sections:
            if "scale" in plan.sections:  # (core runs it too)
                from bench import scale

                scale_plan = scale.ScalePlan.quick() if plan.scale_quick else scale.ScalePlan()
                results["scale"] = await scale.measure(cluster, scale_plan, progress)
            return results
        progress("transports: httpx default pool vs our wire")
        results["transports"] = await transports(receiver, plan)
        progress("relay alone")
        default_batch = RelayConfig().batch_size
        results["relay"] = await relay_alone(cluster, plan, default_batch, fanout=1)
        results["relay_batch_2000"] = await relay_alone(cluster, plan, 2000, fanout=1)
        results["relay_fanout"] = await relay_alone(
            cluster, plan, default_batch, fanout=max(plan.fanouts)
        )
        progress("claim and complete without HTTP")
        results["claim_complete"] = await claim_and_complete(cluster, plan, batch_size=500)
        results["claim_complete_2"] = await claim_and_complete(
            cluster, plan, batch_size=500, processes=2
        )
        progress("publish() per event, with and without an idempotency key")
        results["publish"] = publish_cost(cluster, plan)
        from bench import scale

        scale_plan = scale.ScalePlan.quick() if plan.scale_quick else scale.ScalePlan()
        results["scale"] = await scale.measure(cluster, scale_plan, progress)
        # Ours and the peer alternate so that background noise hits both alike.
        paired: list[dict[str, Any]] = []
        for fanout in plan.fanouts:
            paired.append({"system": "ours", "fanout": fanout, "processes": 1})
            if plan.peer:
                paired.append({"system": "pgqueuer", "fanout": fanout, "processes": 1})
        scaling = [
            {"system": "ours", "fanout": f, "processes": p}
            for f in plan.fanouts
            for p in plan.processes
            if p > 1
        ]
        batched = [
            {"system": "ours", "fanout": 1, "processes": 1, "publish_batch": plan.publish_batch},
            {"system": "ours", "fanout": 1, "processes": 1, "application": "sqlalchemy"},
        ]
        runs = (paired + scaling) * plan.repeat + batched
        for spec in runs:
            progress(f"end to end: {spec}")
            outcome = await end_to_end(cluster, receiver, plan, logs, **spec)
            results["end_to_end"].append(_as_json(outcome))
        progress("worker RSS with deliveries in flight")
        results["rss"] = await rss_in_flight(cluster, receiver, plan, logs)
    results["ratios"] = ratios(results["end_to_end"])
    return results


async def cost_section(
    cluster: Cluster,
    receiver: ReceiverProcess,
    plan: Plan,
    logs: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Issue 26's rows alone (`--only cost`): the floor, the instant drain with 1 and 2
    processes (and 1 with an adaptive endpoint), and ours in the open loop at the highest
    fan-out with 1 and 2 processes."""
    from bench import cost
    from bench.drain import drain, raw_ceiling

    ceiling = await raw_ceiling(receiver, plan)
    queue = cost.floor_queue(
        cluster.database_url(cluster.new_database("floor")),
        cluster.postmaster_pid(),
        plan.floor_jobs,
        plan.worker_batch_size,
    )
    found: dict[str, Any] = {"ceiling": ceiling, "floor": cost.floor(ceiling, queue)}
    for processes in (1, 2):
        progress(f"instant drain, {processes} process(es)")
        found[f"instant_{processes}"] = await drain(
            cluster, receiver, plan, logs, backlog=plan.drain_backlog, path="/drain",
            processes=processes,
        )  # fmt: skip
    progress("instant drain, 1 process, adaptive endpoint")
    found["instant_adaptive"] = await drain(
        cluster, receiver, plan, logs, backlog=plan.drain_backlog, path="/drain",
        concurrency="adaptive",
    )  # fmt: skip
    found["end_to_end"] = []
    for processes in (1, 2):
        spec = {"system": "ours", "fanout": max(plan.fanouts), "processes": processes}
        progress(f"end to end: {spec}")
        outcome = await end_to_end(cluster, receiver, plan, logs, **spec)  # type: ignore[arg-type]
        found["end_to_end"].append(_as_json(outcome))
    return found


def sustained_median(runs: list[dict[str, Any]], **match: Any) -> float | None:
    """The median sustained rate of the repetitions of one configuration (by default one
    event per transaction on a psycopg connection; runs from before the application was
    recorded match either)."""
    match.setdefault("publish_batch", 1)
    match.setdefault("application", "psycopg")
    found = [
        r["sustained_deliveries_per_s"]
        for r in runs
        if all(r.get(key, value) == value for key, value in match.items())
    ]
    return statistics.median(found) if found else None


def ratios(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Ours over pgqueuer's median sustained rate, same fan-out, both with one process."""
    found: dict[str, float | None] = {}
    for fanout in sorted({r["fanout"] for r in runs if r["system"] == "pgqueuer"}):
        ours = sustained_median(runs, system="ours", fanout=fanout, processes=1)
        theirs = sustained_median(runs, system="pgqueuer", fanout=fanout, processes=1)
        found[f"fanout_{fanout}"] = round(ours / theirs, 2) if ours and theirs else None
    return found
