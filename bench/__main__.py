"""`python -m bench [--quick] [--out FILE]`: run the benchmark, print a table, write JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from bench import scale
from bench.harness import Plan, run, sustained_median

TARGETS = {
    "end_to_end": 2000,
    "p99_ms_at_500": 50.0,
    "relay_rows": 30_000,
    "claim_complete": 15_000,
    "peer_ratio": 2.0,
    "rss_mb": 150.0,
}


def _step_at(run_: dict[str, Any], rate: int) -> dict[str, Any] | None:
    return next((s for s in run_["steps"] if s["target_deliveries_per_s"] == rate), None)


def _best_step(run_: dict[str, Any]) -> dict[str, Any] | None:
    sustained = [s for s in run_["steps"] if s["sustained"]]
    return sustained[-1] if sustained else (run_["steps"][0] if run_["steps"] else None)


def _lat(step: dict[str, Any] | None) -> str:
    if not step or not step["latency_ms"]:
        return "-"
    lat = step["latency_ms"]
    return f"{lat['p50']:.0f}/{lat['p99']:.0f}/{lat['p99.9']:.0f}"


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[list[str]]:
    """Each target of issue 7: measured value, goal, met or by how much it is missed."""
    ours = [r for r in results["end_to_end"] if r["system"] == "ours"]
    configurations = {(r["fanout"], r["processes"], r["publish_batch"]) for r in ours}
    best = max(
        (
            sustained_median(ours, fanout=f, processes=p, publish_batch=b) or 0
            for f, p, b in configurations
        ),
        default=0,
    )
    baseline = next((r for r in ours if r["fanout"] == 1 and r["publish_batch"] == 1), None)
    step = _step_at(baseline, 500) if baseline else None
    p99 = step["latency_ms"].get("p99") if step and step["latency_ms"] else None
    ratio_values = [v for v in results["ratios"].values() if v is not None]
    checks: list[tuple[str, float | None, float, bool]] = [
        ("end to end deliveries/s (best median)", best, TARGETS["end_to_end"], True),
        ("p99 ms at 500 events/s (fan-out 1)", p99, TARGETS["p99_ms_at_500"], False),
        (
            "relay delivery rows/s (best of the three)",
            max(
                results[key]["delivery_rows_per_s"]
                for key in ("relay", "relay_batch_2000", "relay_fanout")
            ),
            30_000,
            True,
        ),
        (
            "claim+complete deliveries/s (1 or 2 proc)",
            max(results[k]["deliveries_per_s"] for k in ("claim_complete", "claim_complete_2")),
            15_000,
            True,
        ),
        ("ours / pgqueuer (worst fan-out)", min(ratio_values, default=None), 2.0, True),
        ("worker peak RSS MB, 1,000 in flight", results["rss"]["worker_peak_rss_mb"], 150, False),
    ]
    rows = []
    for name, value, goal, higher in checks:
        if value is None:
            rows.append([name, "-", f"{goal:g}", "not measured"])
            continue
        met = value >= goal if higher else value <= goal
        gap = "met" if met else f"missed by {abs(goal - value) / goal:.0%}"
        rows.append([name, f"{value:g}", f"{'>=' if higher else '<='} {goal:g}", gap])
    return rows


def report(results: dict[str, Any]) -> str:
    e2e_rows = []
    for r in results["end_to_end"]:
        e2e_rows.append(
            [
                r["name"],
                str(r["sustained_deliveries_per_s"]),
                _lat(_step_at(r, 500)),
                _lat(_best_step(r)),
                f"{r['commits_per_delivery']:.2f}",
                f"{r['wal_bytes_per_delivery']:.0f}",
                f"{r['worker_peak_rss_mb']:.0f}",
                f"{r['worker_cpu_ms_per_delivery']:.2f}",
                f"{r['producer_cpu_ms_per_event']:.2f}",
            ]
        )
    relay = results["relay"]
    claim = results["claim_complete"]
    transports = results["transports"]
    rss = results["rss"]
    machine = results["machine"]
    pg = results["postgres"]
    parts = [
        f"machine: {machine['cpus']} cores, {machine['cpu']}, Python {machine['python']}, "
        f"PostgreSQL {pg['server_version']} (synchronous_commit={pg['synchronous_commit']}, "
        f"fsync={pg['fsync']})",
        "",
        "end to end (latency ms p50/p99/p99.9 from scheduled publish to receipt; "
        "'@500' is the 500 deliveries/s step, 'top' the highest sustained step)",
        _table(
            e2e_rows,
            [
                "run",
                "sustained/s",
                "lat @500",
                "lat @top",
                "commits/deliv",
                "WAL B/deliv",
                "peak RSS MB",
                "worker CPU ms/deliv",
                "producer CPU ms/event",
            ],
        ),
        "",
        f"ours / pgqueuer (median sustained rates, 1 process each): {results['ratios']}",
        f"relay alone: {relay['events']} events -> {relay['deliveries']} rows (fan-out "
        f"{relay['fanout']}) in {relay['seconds']} s: {relay['events_per_s']} events/s, "
        f"{relay['delivery_rows_per_s']} rows/s, {relay['wal_bytes_per_delivery']} WAL B/row "
        f"(batch {relay['batch_size']}); batch 2000: "
        f"{results['relay_batch_2000']['delivery_rows_per_s']} rows/s; fan-out "
        f"{results['relay_fanout']['fanout']}: {results['relay_fanout']['events_per_s']} "
        f"events/s, {results['relay_fanout']['delivery_rows_per_s']} rows/s",
        f"claim+complete without HTTP: {claim['deliveries']} in {claim['seconds']} s: "
        f"{claim['deliveries_per_s']}/s (batch {claim['batch_size']}, "
        f"{claim['concurrent_loops']} loops, {claim['commits_per_delivery']} commits/delivery); "
        f"2 processes: {results['claim_complete_2']['deliveries_per_s']}/s",
        f"transport, requests/s from one process: httpx pool {transports['httpx_10']} "
        f"(10 concurrent) / {transports['httpx_100']} (100), aiohttp transport "
        f"{transports['aiohttp_10']} / {transports['aiohttp_100']}",
        f"worker peak RSS: {rss['worker_peak_rss_mb']} MB with {rss['in_flight']} deliveries "
        f"in flight (max_in_flight {rss['max_in_flight']})",
        *scale.report(results["scale"]),
        "",
        "targets (issue 7)",
        _table(targets(results), ["target", "measured", "goal", "verdict"]),
        "",
        "targets (issue 10, ratios within this run)",
        _table(scale.verdicts(results["scale"]), ["target", "measured", "goal", "verdict"]),
        "",
        f"total {results['total_seconds']} s",
    ]
    return "\n".join(parts)


@click.command()
@click.option("--quick", is_flag=True, help="Tiny sizes: a smoke test of the harness (~1 min).")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results.json"),
    show_default=True,
    help="Where to write the JSON results.",
)
@click.option("--no-peer", is_flag=True, help="Skip the pgqueuer runs.")
@click.option("--repeat", type=click.IntRange(min=1), default=None, help="Repeat each run N times.")
def main(quick: bool, out: Path, no_peer: bool, repeat: int | None) -> None:
    """Benchmark webhook-outbox end to end (and pgqueuer on the same workload)."""
    plan = Plan.quick() if quick else Plan()
    if no_peer:
        plan = dataclasses.replace(plan, peer=False)
    if repeat:
        plan = dataclasses.replace(plan, repeat=repeat)
    started = time.monotonic()

    def progress(message: str) -> None:
        click.echo(f"[{time.monotonic() - started:6.1f}s] {message}", err=True)

    results = run(plan, progress)
    out.write_text(json.dumps(results, indent=2))
    click.echo(report(results))
    click.echo(f"results written to {out}", err=True)


if __name__ == "__main__":
    main(sys.argv[1:])
