"""What adaptive concurrency costs the claim: the same drain with every endpoint adaptive and
with none (issue 25, before making adaptive the default for new endpoints).

An endpoint with an in-flight limit (fixed or adaptive) is *gated*: the claim locks its
health row, counts what it has in flight, and the quick path (QUICK_CLAIM_GATES) cannot
take it. Each pair drains `deliveries` due deliveries spread over `endpoints` busy
endpoints in `tenants` tenants, in two fresh databases that differ only in the endpoints'
health rows: none (ungated), or adaptive with a ceiling. The pairs alternate which
variant runs first, so a drift of the shared box within a run favours neither.

    python -m bench.claim_gates [--pairs N] [--endpoints N] [--deliveries N] [--out FILE]

Reported per variant: deliveries/s (wall) and the bench process's CPU seconds per 1,000
deliveries (the worker side of the claim; the server's CPU is in the wall time).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from bench.cluster import Cluster
from bench.components import _vacuum, claim_loops
from bench.scale import _engine, _sql, add_busy_endpoints, add_due_deliveries
from outbox.crypto import SecretBox, generate_key

VARIANTS = ("none", "adaptive")


@dataclass(frozen=True, slots=True)
class GatePlan:
    endpoints: int = 1_000
    tenants: int = 100
    deliveries: int = 20_000
    batch_size: int = 100
    loops: int = 2
    pairs: int = 3
    ceiling: int = 100  # the adaptive endpoints' max_in_flight


async def _drain(
    cluster: Cluster, box: SecretBox, key: str, plan: GatePlan, variant: str, n: int
) -> dict[str, Any]:
    url = cluster.database_url(cluster.new_database(f"gates_{variant}_{n}"))
    engine = _engine(url)
    busy = add_busy_endpoints(engine, box, plan.endpoints, plan.tenants)
    add_due_deliveries(engine, busy, plan.deliveries)
    if variant == "adaptive":
        _sql(
            engine,
            "INSERT INTO endpoint_health (endpoint_id, max_in_flight, adaptive) "
            "SELECT id, :ceiling, true FROM endpoints",
            ceiling=plan.ceiling,
        )
    engine.dispose()
    _vacuum(url)
    cpu_before = time.process_time()
    done, began, ended = await claim_loops(
        url, key, plan.batch_size, plan.loops, f"gates.{variant}"
    )
    cpu = time.process_time() - cpu_before
    seconds = ended - began
    return {
        "deliveries": done,
        "seconds": round(seconds, 2),
        "per_s": round(done / seconds),
        "cpu_s_per_1000": round(1000 * cpu / max(done, 1), 3),
    }


async def measure(cluster: Cluster, plan: GatePlan, progress: Any = print) -> dict[str, Any]:
    key = generate_key("bench")
    box = SecretBox.from_setting(key)
    pairs = []
    for n in range(plan.pairs):
        order = VARIANTS if n % 2 == 0 else tuple(reversed(VARIANTS))
        pair: dict[str, Any] = {"order": list(order)}
        for variant in order:
            pair[variant] = await _drain(cluster, box, key, plan, variant, n)
            progress(f"pair {n + 1}: {variant}: {pair[variant]}")
        pair["ratio"] = round(pair["adaptive"]["per_s"] / pair["none"]["per_s"], 2)
        pairs.append(pair)
    return {
        "plan": asdict(plan),
        "pairs": pairs,
        "adaptive_over_none_median": round(statistics.median(p["ratio"] for p in pairs), 2),
    }


@click.command()
@click.option("--pairs", default=3, show_default=True)
@click.option("--endpoints", default=1_000, show_default=True)
@click.option("--tenants", default=100, show_default=True)
@click.option("--deliveries", default=20_000, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(pairs: int, endpoints: int, tenants: int, deliveries: int, out: Path | None) -> None:
    plan = GatePlan(endpoints=endpoints, tenants=tenants, deliveries=deliveries, pairs=pairs)
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as root:
        cluster = Cluster(Path(root))
        try:
            cluster.start()
            results = asyncio.run(measure(cluster, plan, click.echo))
        finally:
            cluster.stop()
    text = json.dumps(results, indent=2)
    click.echo(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
