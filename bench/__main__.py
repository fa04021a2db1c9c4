"""`python -m bench [--quick] [--out FILE]`: run the benchmark, print a table, write JSON."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

from bench import cost, filters, scale
from bench.components import publish_report
from bench.harness import Plan, run, sustained_median

TARGETS = {
    "end_to_end": 2000,
    "p99_ms_at_1000": 50.0,
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


def _p99_at(run_: dict[str, Any] | None, rate: int) -> float | None:
    step = _step_at(run_, rate) if run_ else None
    return step["latency_ms"].get("p99") if step and step["latency_ms"] else None


def targets(results: dict[str, Any]) -> list[list[str]]:
    """Each target of issues 7 and 11: measured value, goal, met or by how much it is missed."""
    checks: list[tuple[str, float | None, float, bool]] = []
    if results["end_to_end"]:
        ours = [r for r in results["end_to_end"] if r["system"] == "ours"]
        configurations = {(r["fanout"], r["processes"], r["publish_batch"]) for r in ours}
        best = max(
            (
                sustained_median(ours, fanout=f, processes=p, publish_batch=b) or 0
                for f, p, b in configurations
            ),
            default=0,
        )
        fanout_1 = [
            r
            for r in ours
            if r["fanout"] == 1
            and r["publish_batch"] == 1
            and r.get("application", "psycopg") == "psycopg"
        ]
        baseline = fanout_1[0] if fanout_1 else None
        p99_1000 = [p for r in fanout_1 if r["processes"] == 1 if (p := _p99_at(r, 1000))]
        top_fanout = max(r["fanout"] for r in ours)
        p99_1000_wide = [
            p
            for r in ours
            if r["fanout"] == top_fanout > 1 and r["processes"] == 1 and r["publish_batch"] == 1
            if (p := _p99_at(r, 1000))
        ]
        ratios = results["ratios"]
        checks += [
            ("end to end deliveries/s (best median)", best, TARGETS["end_to_end"], True),
            (
                "end to end deliveries/s, fan-out 1, 1 process (median)",
                sustained_median(ours, fanout=1, processes=1),
                TARGETS["end_to_end"],
                True,
            ),
            ("p99 ms at 500/s (fan-out 1)", _p99_at(baseline, 500), 50.0, False),
            (
                "p99 ms at 1000/s (fan-out 1, worst run)",
                max(p99_1000, default=None),
                TARGETS["p99_ms_at_1000"],
                False,
            ),
            (
                f"p99 ms at 1000/s (fan-out {top_fanout}, 1 process, worst run)",
                max(p99_1000_wide, default=None),
                TARGETS["p99_ms_at_1000"],
                False,
            ),
            (
                "relay delivery rows/s (best of the three)",
                max(
                    results[key]["delivery_rows_per_s"]
                    for key in ("relay", "relay_batch_2000", "relay_fanout")
                ),
                TARGETS["relay_rows"],
                True,
            ),
            (
                "claim+complete deliveries/s (1 or 2 proc)",
                max(results[k]["deliveries_per_s"] for k in ("claim_complete", "claim_complete_2")),
                TARGETS["claim_complete"],
                True,
            ),
        ]
        for key in sorted(ratios):
            checks.append(
                (
                    f"ours / pgqueuer, {key.replace('_', ' ')}",
                    ratios[key],
                    TARGETS["peer_ratio"],
                    True,
                )
            )
        for other in results.get("consecutive", []):  # bench/readme.py's full-run supplements
            checks += [
                (
                    f"ours / pgqueuer, {key.replace('_', ' ')} ({other['file']})",
                    value,
                    TARGETS["peer_ratio"],
                    True,
                )
                for key, value in sorted(other["ratios"].items())
            ]
        checks.append(
            (
                "worker peak RSS MB, 1,000 in flight",
                results["rss"]["worker_peak_rss_mb"],
                TARGETS["rss_mb"],
                False,
            )
        )
    if "drain" in results:
        drain = results["drain"]
        names = {
            "slow_share_of_slots": "drain to a 200 ms partner / (slots / latency)",
            "instant_share_of_ceiling": "drain to an instant partner / raw aiohttp ceiling",
            "two_over_one": "drain with 2 processes / 1 process",
        }
        for key, name in names.items():
            checks.append((name, drain["ratios"][key], drain["targets"][key], True))
    for run_name, over_floor in cost_ratios(results).items():
        checks.append(
            (f"whole CPU per delivery / floor, {run_name}", over_floor, cost.TARGET, False)
        )
    if model := capacity(results):
        checks.append(
            ("capacity model, 2 processes: |predicted / measured - 1|", abs(model["error"]),
             cost.CAPACITY_ERROR, False)
        )  # fmt: skip
    flat = results.get("flat")
    checks.append(
        (
            f"slowdown with {flat['grown']['backlog']:,} backlog, "
            f"{flat['grown']['history']:,} history (worst of relay, claim+record)"
            if flat
            else "slowdown with 1,000,000 backlog, 10,000,000 history",
            flat["worst_slowdown"] if flat else None,
            1.2,
            False,
        )
    )
    rows = []
    for name, value, goal, higher in checks:
        if value is None:
            rows.append([name, "-", f"{'>=' if higher else '<='} {goal:g}", "not measured"])
            continue
        met = value >= goal if higher else value <= goal
        gap = "met" if met else f"missed by {abs(goal - value) / goal:.0%}"
        rows.append([name, f"{value:g}", f"{'>=' if higher else '<='} {goal:g}", gap])
    return rows


def target_table(results: dict[str, Any]) -> str:
    return _table(targets(results), ["target", "measured", "goal", "verdict"])


def drain_report(drain: dict[str, Any]) -> list[str]:
    """The backlog-drain rows (issue 11), each with its ratio, target and verdict."""
    slow, ceiling = drain["slow"], drain["ceiling"]
    one, two = drain["instant_1"], drain["instant_2"]
    ratios, goals = drain["ratios"], drain["targets"]
    rows = [
        [
            f"slow partner ({slow['latency_ms']} ms), {slow['backlog']} backlog",
            f"{slow['deliveries_per_s']}/s",
            f"{slow['slots']} slots / {slow['latency_ms']} ms = {slow['slots_per_latency']:g}/s",
            "slow_share_of_slots",
        ],
        [
            f"instant partner, {one['backlog']} backlog, 1 process",
            f"{one['deliveries_per_s']}/s",
            f"raw aiohttp ceiling {ceiling['requests_per_s']}/s",
            "instant_share_of_ceiling",
        ],
        [
            "instant partner, 2 processes",
            f"{two['deliveries_per_s']}/s",
            f"1 process {one['deliveries_per_s']}/s",
            "two_over_one",
        ],
    ]
    table = []
    for name, rate, against, key in rows:
        value, goal = ratios[key], goals[key]
        verdict = "met" if value >= goal else f"missed by {(goal - value) / goal:.0%}"
        table.append([name, rate, against, f"{value:g}", f">= {goal:g}", verdict])
    cpu = ", ".join(
        f"{label} {drain[key]['worker_cpu_ms_per_delivery']:.3f}"
        for label, key in (("slow", "slow"), ("instant", "instant_1"), ("2 proc", "instant_2"))
    )
    return [
        "backlog drains (issue 11; first arrival to last answer, ratios within this run)",
        "",
        _table(table, ["drain", "rate", "against", "ratio", "goal", "verdict"]),
        "",
        f"worker CPU ms per delivery during the drains: {cpu}",
    ]


def _cost_runs(results: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(row name, whole cost, table stats) of each measured run, drains first."""
    found: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    drain = _cost_source(results)
    for key, name in (
        ("instant_1", "instant drain, 1 process"),
        ("instant_2", "instant drain, 2"),
        ("instant_adaptive", "instant drain, 1 process, adaptive endpoint"),
    ):
        if "cost" in drain.get(key, {}):
            found.append((name, drain[key]["cost"]["whole"], drain[key]["cost"]["table"]))
    for run_ in _end_to_end_runs(results):
        if run_.get("cost"):
            found.append((f"open loop: {run_['name']}", run_["cost"], run_.get("table")))
    return found


def _cost_source(results: dict[str, Any]) -> dict[str, Any]:
    """Where the floor and the instant drains are: `--only cost`'s section, or the drains."""
    found: dict[str, Any] = results.get("cost") or results.get("drain") or {}
    return found


def _end_to_end_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [*results.get("end_to_end", []), *results.get("cost", {}).get("end_to_end", [])]


def cost_ratios(results: dict[str, Any]) -> dict[str, float]:
    """Whole over floor for the issue's two runs: the instant drain (1 process) and the
    open loop at the highest fan-out with 1 process (median of its repetitions)."""
    floor = _cost_source(results).get("floor")
    if not floor:
        return {}
    found: dict[str, float] = {}
    drain = _cost_source(results)["instant_1"]
    if "cost" in drain:
        found["instant drain"] = cost.ratio(drain["cost"]["whole"], floor)
    adaptive = _cost_source(results).get("instant_adaptive", {})
    if "cost" in adaptive:
        found["instant drain, adaptive endpoint"] = cost.ratio(adaptive["cost"]["whole"], floor)
    ours = [
        r
        for r in _end_to_end_runs(results)
        if r["system"] == "ours" and r.get("cost") and r["processes"] == 1
        and r["publish_batch"] == 1 and r.get("application", "psycopg") == "psycopg"
    ]  # fmt: skip
    if ours:
        top = max(r["fanout"] for r in ours)
        each = [cost.ratio(r["cost"], floor) for r in ours if r["fanout"] == top]
        found[f"open loop fan-out {top}"] = round(statistics.median(each), 2)
    return found


def capacity(results: dict[str, Any]) -> dict[str, Any] | None:
    """The capacity model's check on this run's drains (bench/cost.py `capacity`)."""
    cpus = results.get("machine", {}).get("cpus")
    return cost.capacity(_cost_source(results), cpus) if cpus else None


def cost_report(results: dict[str, Any]) -> list[str]:
    """Issue 26: CPU per delivery of everything the service runs, against the floor."""
    runs = _cost_runs(results)
    floor = _cost_source(results).get("floor")
    if not runs and not floor:
        return []
    rows = [
        [
            name,
            str(whole["deliveries"]),
            f"{whole['service_cpu_ms']:.3f}",
            f"{whole['postgres_cpu_ms']:.3f}",
            f"{whole['whole_cpu_ms']:.3f}",
            f"{cost.ratio(whole, floor):.2f}" if floor else "-",
            f"{whole['wal_bytes']}",
            f"{whole['commits']:.3f}",
        ]
        for name, whole, _ in runs
    ]
    if floor:
        queue = floor["queue"]
        rows.append(
            [
                f"floor: raw HTTP client {floor['http_client_cpu_ms']:.3f} + queue "
                f"(insert, mark done; batch {queue['batch']}) in PostgreSQL",
                str(queue["jobs"]),
                f"{floor['http_client_cpu_ms']:.3f}",
                f"{floor['queue_postgres_cpu_ms']:.3f}",
                f"{floor['cpu_ms']:.3f}",
                "1",
                f"{queue['wal_bytes']}",
                f"{queue['commits']:.3f}",
            ]
        )
    headers = [
        "run",
        "deliveries",
        "service CPU ms",
        "PostgreSQL CPU ms",
        "whole CPU ms",
        "whole/floor",
        "WAL B",
        "commits",
    ]
    lines = [
        "cost per delivery (issue 26; CPU ms, WAL bytes and commits per delivery; service = "
        "outbox run's processes, or the floor's HTTP client; PostgreSQL = the whole server "
        "less the application's backends; drains include the relay's fan-out)",
        "",
        _table(rows, headers),
    ]
    if model := capacity(results):
        lines += [
            "",
            f"capacity model (docs/scaling.md): 2 processes predicted "
            f"{model['predicted_2_per_s']}/s from 1 process's "
            f"{model['one_process_per_s']}/s keeping {model['one_process_box_share']:.0%} of "
            f"{model['cpus']} cores less {model['others_busy_cores']} busy elsewhere "
            f"(bounds: 2 x that, {model['cpus']} cores / "
            f"{model['cpu_ms_per_delivery']:.3f} ms whole + partner = "
            f"{model['box_bound_per_s']}/s); measured {model['measured_2_per_s']}/s "
            f"({model['error']:+.0%}; the bounds alone {model['bounds_error']:+.0%}; busy "
            f"elsewhere meanwhile {model['others_busy_cores_2']})",
        ]
    tables = [(name, table) for name, _, table in runs if table]
    if tables:
        lines += [
            "",
            "deliveries table after each run: "
            + "; ".join(
                f"{name}: {t['indexes']} indexes, HOT {t['hot_updates']}/{t['updates']} "
                f"updates ({t['hot_ratio']:.0%})"
                for name, t in tables
            ),
        ]
    return lines


def flat_report(results: dict[str, Any]) -> list[str]:
    flat = results.get("flat")
    if not flat:
        return []
    empty, grown = flat["empty"], flat["grown"]
    return [
        f"flat cost: relay {empty['relay_rows_per_s']} rows/s empty, "
        f"{grown['relay_rows_per_s']} grown; claim+record {empty['claim_complete_per_s']}/s "
        f"empty, {grown['claim_complete_per_s']}/s grown ({grown['backlog']:,} backlog, "
        f"{grown['history']:,} history rows built in {grown['build_seconds']:g} s); "
        f"slowdown {flat['slowdown']}",
        "",
    ]


def end_to_end_report(results: dict[str, Any]) -> list[str]:
    """Each end-to-end run: sustained rate, latencies, and what a delivery cost."""
    rows = [
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
        for r in results["end_to_end"]
    ]
    headers = [
        "run",
        "sustained/s",
        "lat @500",
        "lat @top",
        "commits/deliv",
        "WAL B/deliv",
        "peak RSS MB",
        "worker CPU ms/deliv",
        "producer CPU ms/event",
    ]
    return [
        "end to end (latency ms p50/p99/p99.9 from scheduled publish to receipt; "
        "'@500' is the 500 deliveries/s step, 'top' the highest sustained step)",
        "",
        _table(rows, headers),
    ]


def report(results: dict[str, Any]) -> str:
    if not results["end_to_end"]:  # --only drain / flat / scale
        parts = [*drain_report(results["drain"]), ""] if "drain" in results else []
        parts += [*lines, ""] if (lines := cost_report(results)) else []
        if "scale" in results:
            parts += [
                *scale.report(results["scale"]),
                *([filters.report(results["filters"])] if "filters" in results else []),
                "",
                "targets (issue 10, ratios within this run)",
                _table(scale.verdicts(results["scale"]), ["target", "measured", "goal", "verdict"]),
                "",
            ]
        if "filters" in results:
            parts += [filters.report(results["filters"]), ""]
        if "publish" in results:
            parts += [publish_report(results["publish"]), ""]
        return "\n".join([*parts, *flat_report(results), target_table(results)])
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
        *end_to_end_report(results),
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
        *([publish_report(results["publish"])] if "publish" in results else []),
        f"transport, requests/s from one process: httpx pool {transports['httpx_10']} "
        f"(10 concurrent) / {transports['httpx_100']} (100), our wire "
        f"{transports['wire_10']} / {transports['wire_100']}",
        f"worker peak RSS: {rss['worker_peak_rss_mb']} MB with {rss['in_flight']} deliveries "
        f"in flight (max_in_flight {rss['max_in_flight']})",
        *scale.report(results["scale"]),
        "",
        "targets (issues 7 and 11)",
        target_table(results),
        "",
        "targets (issue 10, ratios within this run)",
        _table(scale.verdicts(results["scale"]), ["target", "measured", "goal", "verdict"]),
        "",
        *([*drain_report(results["drain"]), ""] if "drain" in results else []),
        *([*lines, ""] if (lines := cost_report(results)) else []),
        *flat_report(results),
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
@click.option(
    "--only",
    type=click.Choice(
        ["core", "drain", "flat", "scale", "filters", "publish", "migration", "adaptive", "cost"]
    ),
    multiple=True,
    help="Run only these sections (repeatable): core = end to end, relay, claim, scale, RSS; "
    "drain = backlog "
    "drains, flat = grown tables against empty ones, scale = issue 10's figures alone, "
    "filters = relay rate with 1,000 filtered endpoints against 1,000 unfiltered ones, "
    "publish = publish() per event with and without an idempotency key (core runs it too), "
    "cost = issue 26's rows alone (the floor, the instant drains, ours in the open loop at "
    "the highest fan-out with 1 and 2 processes), "
    "migration = stalls while this release migrates the previous one's schema under load "
    "(only with --only), adaptive = adaptive concurrency against fixed in-flight limits "
    "on a partner that slows down and answers 429 (only with --only).",
)
@click.option(
    "--event-loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="OUTBOX_EVENT_LOOP of the worker processes (to compare loops).",
)
def main(
    quick: bool,
    out: Path,
    no_peer: bool,
    repeat: int | None,
    only: tuple[str, ...],
    event_loop: str,
) -> None:
    """Benchmark webhook-outbox end to end (and pgqueuer on the same workload)."""
    plan = Plan.quick() if quick else Plan()
    plan = dataclasses.replace(plan, event_loop=event_loop)
    if no_peer:
        plan = dataclasses.replace(plan, peer=False)
    if only:
        plan = dataclasses.replace(plan, sections=only)
    if repeat:
        plan = dataclasses.replace(plan, repeat=repeat)
    started = time.monotonic()

    def progress(message: str) -> None:
        click.echo(f"[{time.monotonic() - started:6.1f}s] {message}", err=True)

    if "adaptive" in only:
        from bench import adaptive

        if set(only) != {"adaptive"}:
            raise click.UsageError("--only adaptive runs on its own server: run it alone")
        plan_ = adaptive.AdaptivePlan.quick() if quick else adaptive.AdaptivePlan()
        measured = adaptive.measure(plan_, progress)
        out.write_text(json.dumps({"adaptive": measured}, indent=2))
        click.echo("\n".join(adaptive.report(measured)))
        click.echo(f"results written to {out}", err=True)
        return
    if "migration" in only:
        from bench import migration_stall

        if set(only) != {"migration"}:
            raise click.UsageError("--only migration runs on its own server: run it alone")
        stall_plan = migration_stall.StallPlan.quick() if quick else migration_stall.StallPlan()
        stalls = migration_stall.measure(stall_plan, progress)
        out.write_text(json.dumps({"migration": stalls}, indent=2))
        click.echo("\n".join(migration_stall.report(stalls)))
        click.echo(f"results written to {out}", err=True)
        return
    results = run(plan, progress)
    out.write_text(json.dumps(results, indent=2))
    click.echo(report(results))
    click.echo(f"results written to {out}", err=True)


if __name__ == "__main__":
    main(sys.argv[1:])
