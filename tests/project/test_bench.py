"""The benchmark harness itself, in its quick mode at tiny sizes, so it cannot rot.

This runs everything `python -m bench` runs (its own embedded PostgreSQL, the
receiver process, `outbox run` with 1 and 2 processes, pgqueuer, relay alone,
claim and complete, the transport comparison and the RSS probe) and checks that
every figure is there and adds up. It says nothing about speed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.__main__ import report
from bench.components import publish_cost, publish_report
from bench.harness import Plan, ratios, run
from bench.stats import percentiles
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import add_endpoint


def test_percentiles_use_nearest_rank() -> None:
    values = [float(v) for v in range(1, 1001)]
    found = percentiles(values)
    assert found["p50"] == 500
    assert found["p99"] == 990
    assert found["p99.9"] == 999
    assert found["max"] == 1000
    assert found["count"] == 1000
    assert percentiles([]) == {}


def test_ratios_compare_producers_on_the_same_kind_of_connection() -> None:
    """Ours over pgqueuer uses the psycopg-application runs on both sides; the SQLAlchemy
    application's run is reported beside them, not mixed into the ratio."""

    def run_(system: str, rate: int, application: str | None) -> dict[str, object]:
        found: dict[str, object] = {
            "system": system, "fanout": 1, "processes": 1, "publish_batch": 1,
            "sustained_deliveries_per_s": rate,
        }  # fmt: skip
        if application is not None:
            found["application"] = application
        return found

    runs = [
        run_("ours", 1500, "psycopg"),
        run_("ours", 1000, "psycopg"),
        run_("ours", 250, "sqlalchemy"),
        run_("pgqueuer", 500, "psycopg"),
    ]
    assert ratios(runs) == {"fanout_1": 2.5}  # median 1250 over 500
    # a run recorded before the application was: counted whatever its producer was
    assert ratios([run_("ours", 1000, None), run_("pgqueuer", 500, None)]) == {"fanout_1": 2.0}


@pytest.mark.slow
def test_quick_benchmark_measures_every_figure() -> None:
    plan = dataclasses.replace(
        Plan.quick(),
        ours_rates=(30,),
        peer_rates=(30,),
        step_seconds=0.5,
        # Fan-out 2 alone: its runs take every path fan-out 1's do (ours with 1 and 2
        # processes, pgqueuer, the ratio) and more (several endpoints per event); the
        # batched and SQLAlchemy runs stay at fan-out 1. Three worker starts fewer.
        fanouts=(2,),
        relay_events=100,
        claim_deliveries=100,
        transport_seconds=0.1,
        rss_in_flight=20,
        slow_delay=1.0,
        drain_slow_backlog=150,
        drain_backlog=100,
        floor_jobs=200,
        publish_events=10,
        flat_backlog=300,
        flat_history=1_000,
        flat_events=50,
    )
    messages: list[str] = []
    results = run(plan, messages.append)

    assert results["relay"]["events"] == 100
    assert results["relay"]["deliveries"] == 100
    assert results["relay_fanout"]["deliveries"] == 200  # fan-out 2
    assert results["claim_complete"]["deliveries"] == 100
    assert results["claim_complete_2"]["deliveries"] == 100  # two processes, none twice
    assert all(results["transports"][f"{t}_{c}"] > 0 for t in ("httpx", "wire") for c in (10, 100))
    assert results["relay_batch_2000"]["deliveries"] == 100
    assert results["rss"]["in_flight"] == 20
    assert results["rss"]["worker_peak_rss_mb"] > 0

    runs = {
        (r["system"], r["fanout"], r["processes"], r["publish_batch"], r["application"])
        for r in results["end_to_end"]
    }
    assert runs == {
        ("ours", 1, 1, 4, "psycopg"),
        ("ours", 1, 1, 1, "sqlalchemy"),
        ("ours", 2, 1, 1, "psycopg"),
        ("ours", 2, 2, 1, "psycopg"),
        ("pgqueuer", 2, 1, 1, "psycopg"),
    }
    for outcome in results["end_to_end"]:
        [step] = outcome["steps"]
        assert step["drained"], outcome
        events = round(step["events_per_s"] * plan.step_seconds)
        assert step["latency_ms"]["count"] >= events * outcome["fanout"] - outcome["fanout"]
        assert outcome["deliveries"] >= step["latency_ms"]["count"]
        assert outcome["commits_per_delivery"] > 0
        assert outcome["wal_bytes_per_delivery"] > 0
        assert outcome["worker_peak_rss_mb"] > 0
        assert outcome["worker_cpu_ms_per_delivery"] > 0
        assert outcome["producer_cpu_ms_per_event"] > 0
        assert outcome["unsigned_requests"] == 0
        # Issue 26: the whole cost over the steps, ours with a psycopg application only.
        measured = outcome["system"] == "ours" and outcome["application"] == "psycopg"
        assert (outcome["cost"] is not None) == measured, outcome
        if measured:
            assert outcome["cost"]["deliveries"] >= step["latency_ms"]["count"]
            assert outcome["cost"]["service_cpu_ms"] > 0
            assert outcome["cost"]["postgres_cpu_ms"] > 0
            assert outcome["cost"]["wal_bytes"] > 0
            assert outcome["table"]["indexes"] == 14
            # at least the outcome's update each (a delivery the relay hands to its own
            # worker is inserted claimed: no claim update)
            assert outcome["table"]["updates"] >= outcome["deliveries"]
    # one ratio per fan-out the peer ran, though fan-out 1 has ours' batched runs
    assert set(results["ratios"]) == {"fanout_2"}

    # Scale (issue 10), at its quick sizes: every drain delivered everything due, the relay
    # fanned each event out to the busy endpoint only, and both ratios have a verdict.
    scale = results["scale"]
    deliveries = scale["plan"]["deliveries"]
    assert [r["deliveries"] for r in scale["idle"].values()] == [deliveries] * 3
    assert scale["idle"]["1000"]["endpoints"] == 1 + 1000 + 20
    assert scale["many_busy"]["deliveries"] == scale["alone_again"]["deliveries"] == deliveries
    assert len(scale["pairs"]) == scale["plan"]["pairs"]
    for pair in scale["pairs"]:
        assert pair["alone"]["deliveries"] == pair["many"]["deliveries"] == deliveries
        assert pair["ratio"] == round(pair["many"]["per_s"] / pair["alone"]["per_s"], 2)
    relay_events = scale["plan"]["relay_events"]
    assert all(r["deliveries"] == r["events"] == relay_events for r in scale["relay"].values())
    assert set(scale["ratios"]) == {
        "idle_max_over_none",
        "many_busy_over_one",
        "relay_max_over_none",
    }

    drain = results["drain"]
    for key, backlog in (("slow", 150), ("instant_1", 100), ("instant_2", 100)):
        # Every delivery of the backlog arrived exactly once, and the drain was timed.
        assert drain[key]["arrived"] == drain[key]["distinct"] == backlog, drain[key]
        assert drain[key]["deliveries_per_s"] > 0
    assert drain["instant_2"]["processes"] == 2
    assert drain["ceiling"]["requests_per_s"] > 0
    assert set(drain["ratios"]) == set(drain["targets"]) == set(drain["verdicts"])
    # Issue 26: the whole cost of each instant drain (relay included) and the floor.
    for key in ("instant_1", "instant_2"):
        whole = drain[key]["cost"]["whole"]
        assert whole["whole_cpu_ms"] == pytest.approx(
            whole["service_cpu_ms"] + whole["postgres_cpu_ms"], abs=1e-3
        )
        assert whole["postgres_cpu_ms"] > 0 and whole["wal_bytes"] > 0 and whole["commits"] > 0
        table = drain[key]["cost"]["table"]
        assert (table["inserts"], table["updates"]) == (100, 200)  # a claim and an outcome each
    # The default endpoint (adaptive) drained too, its cost beside the fixed one's.
    adaptive = drain["instant_adaptive"]
    assert adaptive["concurrency"] == "adaptive" and drain["instant_1"]["concurrency"] == "fixed"
    assert adaptive["arrived"] == adaptive["distinct"] == 100
    assert adaptive["cost"]["whole"]["whole_cpu_ms"] > 0
    assert adaptive["cost"]["table"]["inserts"] == 100
    floor = drain["floor"]
    assert floor["queue"]["jobs"] == plan.floor_jobs
    assert floor["cpu_ms"] == pytest.approx(
        floor["http_client_cpu_ms"] + floor["queue_postgres_cpu_ms"], abs=1e-3
    )
    assert floor["http_client_cpu_ms"] > 0 and floor["queue_postgres_cpu_ms"] > 0

    flat = results["flat"]
    assert flat["grown"]["backlog"] == plan.flat_backlog
    assert flat["grown"]["history"] == plan.flat_history
    for side in ("empty", "grown"):
        # The same measured work on both sides: every new event relayed, claimed, recorded
        # (and the backlog, due tomorrow, never claimed).
        total = plan.flat_events * plan.flat_rounds
        assert flat[side]["relayed"] == flat[side]["claimed_and_recorded"] == total
    assert flat["worst_slowdown"] == max(flat["slowdown"].values()) > 0

    publish = results["publish"]
    assert publish["rows"] == publish["rows_expected"]
    assert all(v > 0 for size in ("small", "large") for v in publish[size]["us_per_event"].values())

    text = report(results)
    assert "publish() µs per event (10 events" in text
    assert "pgqueuer fan-out 2" in text
    assert "targets (issues 7 and 11)" in text
    assert "targets (issue 10, ratios within this run)" in text
    assert "busy endpoints / one busy" in text
    assert "slowdown with 300 backlog, 1,000 history" in text
    assert "instant_share_of_ceiling" not in text  # rows are named, ratios shown
    assert "raw aiohttp ceiling" in text and "slow partner (200 ms)" in text
    assert "whole CPU per delivery / floor, instant drain" in text
    assert "whole CPU per delivery / floor, open loop fan-out 2" in text
    assert "floor: raw HTTP client" in text and "14 indexes, HOT" in text
    assert "instant drain, 1 process, adaptive endpoint" in text
    assert "whole CPU per delivery / floor, instant drain, adaptive endpoint" in text
    assert "capacity model (docs/scaling.md): 2 processes predicted" in text
    assert "capacity model, 2 processes: |predicted / measured - 1|" in text


class _OneDatabase:
    """What publish_cost asks of a bench cluster, answered with the test's database."""

    def __init__(self, url: str) -> None:
        self.url = url

    def new_database(self, label: str) -> str:
        return label

    def database_url(self, name: str) -> str:
        return self.url


def test_publish_cost_measures_each_variant_and_a_key_again_writes_nothing(
    database_url: str,
) -> None:
    plan = dataclasses.replace(Plan.quick(), publish_events=10, publish_rounds=2)
    measured = publish_cost(_OneDatabase(database_url), plan)  # type: ignore[arg-type]
    # warm-ups and rounds of unkeyed and new-keyed events; "same key again" adds no row
    assert measured["rows"] == measured["rows_expected"] == 2 * (2 * 10 + 2 * 10 * 2)
    for size, payload_bytes in (("small", 60), ("large", 14919)):
        row = measured[size]
        assert row["payload_bytes"] == payload_bytes
        assert set(row["us_per_event"]) == {"no key", "new key", "same key again"}
        assert all(v > 0 for v in row["us_per_event"].values())
        assert row["hash_alone_us"] >= 0
    line = publish_report(measured)
    assert line.startswith("publish() µs per event (10 events, 100 a transaction, median of 2")
    assert "14919 B payload: no key " in line


def test_the_longest_delivery_gap_counts_a_gap_across_the_window_edges() -> None:
    from bench.migration_stall import _longest_gap

    arrivals = [0.0, 1.0, 1.2, 1.3, 4.0, 4.1]
    # Inside [1.1, 3.0] the partner saw 1.2 -> 1.3, then nothing until 4.0: 2.7 s.
    assert _longest_gap(arrivals, 1.1, 3.0) == pytest.approx(2.7)
    # A window with no delivery at all: the whole stretch between its neighbours.
    assert _longest_gap(arrivals, 2.0, 3.0) == pytest.approx(2.7)
    assert _longest_gap([], 2.0, 3.0) == pytest.approx(1.0)
    assert _longest_gap(arrivals, 0.5, 1.25) == pytest.approx(1.0)  # 0.0 -> 1.0


def test_the_capacity_model_queues_two_processes_for_the_shared_cores() -> None:
    """bench/cost.py `capacity`: 2 processes drain less than twice what one does, by the
    wait for the cores the other process keeps busy, and never more than the box's cores
    over the whole CPU a delivery costs (service, PostgreSQL, partner)."""
    from bench.cost import capacity, closed_loop_rate

    def drains(
        one_rate: int, whole_ms: float, two_rate: int, others: float = 0.0
    ) -> dict[str, object]:
        spent = {"whole_cpu_ms": whole_ms, "receiver_cpu_ms": 0.05, "others_busy_cores": others}
        return {
            "instant_1": {"deliveries_per_s": one_rate, "cost": {"drain": spent}},
            "instant_2": {"deliveries_per_s": two_rate, "cost": {"drain": {}}},
        }

    # 2,500/s at 0.5 ms keeps 62.5 % of 2 cores busy: 2 x 2,500 / (1 + 0.625^2) = 3,596/s,
    # under both bounds (5,000 and 2 cores / 0.5 ms = 4,000)
    near = capacity(drains(2500, 0.45, 3200), cpus=2)
    assert near is not None
    assert near["one_process_box_share"] == 0.625
    assert (near["box_bound_per_s"], near["bounds_2_per_s"]) == (4000, 4000)
    assert (near["predicted_2_per_s"], near["error"], near["bounds_error"]) == (3596, 0.124, 0.25)
    # a process that keeps little of the box busy: close to twice one process
    idle = capacity(drains(200, 0.45, 390), cpus=2)
    assert idle is not None and idle["predicted_2_per_s"] == 399
    # more cores: less of them busy, less waiting
    wide = capacity(drains(2500, 0.45, 3200), cpus=4)
    assert wide is not None and wide["box_bound_per_s"] == 8000
    assert wide["predicted_2_per_s"] == 4555
    # a core busy with something else during the 1-process drain is not the service's:
    # 1,000/s at 0.5 ms keeps half of the one core left busy, 2,000 / 1.25 = 1,600/s
    # (a quarter of two free cores: 2,000 / 1.0625 = 1,882/s)
    shared = capacity(drains(1000, 0.45, 1600, others=1.0), cpus=2)
    assert shared is not None and shared["one_process_box_share"] == 0.5
    assert (shared["predicted_2_per_s"], shared["error"]) == (1600, 0.0)
    free = capacity(drains(1000, 0.45, 1600), cpus=2)
    assert free is not None and free["predicted_2_per_s"] == 1882
    # one process is itself; many approach the box's bound from below and never pass it
    assert closed_loop_rate(2500, 0.625, 1) == pytest.approx(2500)
    many = [closed_loop_rate(2500, 0.625, n) for n in range(1, 10)]
    assert all(a < b < 4000 for a, b in itertools.pairwise(many))
    assert closed_loop_rate(2500, 0.625, 40) == pytest.approx(4000, rel=0.001)
    assert capacity({"instant_1": {"deliveries_per_s": 1}}, cpus=2) is None


async def test_a_drain_window_opens_once_every_process_holds_a_claim(
    engine: Engine, async_engine: AsyncEngine, box: SecretBox, clock: ManualClock, database_url: str
) -> None:
    """bench/drain.py: a 2-process drain is timed and costed from when both processes hold
    claims (the later one's start-up is not the drain's); a backlog gone before that says
    so at once instead of waiting for the deadline."""
    from bench.drain import _all_claiming

    add_endpoint(engine, box, "https://partner.example/hook")
    with engine.begin() as conn:
        for _ in range(3):
            publish(conn, "bench.x", {})
    await Relay(async_engine, clock).run_until_idle()

    def claim(worker: str, state: str = "in_flight") -> None:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE deliveries SET state = :state, locked_by = :worker,"
                    " lease_expires_at = now() + interval '1 hour'"
                    " WHERE id = (SELECT min(id) FROM deliveries WHERE state = 'scheduled')"
                ),
                {"worker": worker, "state": state},
            )

    later = time.time() + 60
    assert await _all_claiming(database_url, 1, later) == "all"  # one process: at once
    claim("a")
    began = time.monotonic()
    # the patience is over: the window opens without the process that claims nothing
    assert await _all_claiming(database_url, 2, time.time()) == "waited"
    claim("a")
    claim("b")  # the last scheduled row: the second process holds a claim
    assert await _all_claiming(database_url, 2, later) == "all"
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE deliveries SET state = 'scheduled', locked_by = NULL,"
                " lease_expires_at = NULL WHERE locked_by = 'b'"
            )
        )
        conn.execute(
            text(
                "UPDATE deliveries SET locked_by = NULL, lease_expires_at = NULL,"
                " state = 'succeeded', completed_at = now() WHERE locked_by = 'a'"
                " AND id = (SELECT min(id) FROM deliveries)"
            )
        )
    claim("a")  # one process took the whole backlog before the other claimed anything
    assert await _all_claiming(database_url, 2, later) == "gone"
    assert time.monotonic() - began < 30  # it did not wait for the deadline
