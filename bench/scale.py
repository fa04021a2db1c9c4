"""Scale: does the cost follow the work, or the number of endpoints and tenants? (issue 10)

Every figure comes from a fresh database of the benchmark's cluster, built with
set-based SQL (generate_series), never row by row:

    drain          the worker's own claim and record paths (the HTTP attempt replaced by a
                   success, as in `claim_and_complete`) draining `deliveries` due
                   deliveries to ONE busy endpoint, with 0, 10,000 and 100,000 idle
                   endpoints beside it, spread over 10,000 tenants (a third subscribed to
                   '*', a third to 'order.*', the busy event type's prefix, a third to an
                   exact other type; all with a health row, a tenth of them gated by a
                   concurrency limit; some idle endpoints in the busy tenant itself)
    many busy      the same number of deliveries spread over 1,000 busy endpoints in 100
                   tenants, no idle ones: the total rate against one busy endpoint's
    relay          relay rows/s for the busy tenant's events (fan-out 1) with the idle
                   catalogue in place, and without it

Targets, as ratios within one run: 100,000 idle >= 0.8 of none; 1,000 busy >= 0.8 of one.
The idle ratio's base is the better of the one-busy-endpoint drain before the idle
catalogues and right after them; the busy ratio is the median of `pairs` adjacent pairs
(one busy endpoint alone, then the same deliveries over the busy endpoints).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, text

from bench.cluster import PAYLOAD, Cluster
from bench.components import _vacuum, claim_loops
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key, generate_secret
from outbox.db import make_async_engine, sqlalchemy_url
from outbox.endpoints import secret_context
from outbox.relay import Relay, RelayConfig

BUSY_TENANT = "busy"
TARGET_RATIO = 0.8


@dataclass(frozen=True, slots=True)
class ScalePlan:
    tenants: int = 10_000
    idle: tuple[int, ...] = (0, 10_000, 100_000)
    busy_endpoints: int = 1_000
    busy_tenants: int = 100
    deliveries: int = 20_000
    batch_size: int = 100
    loops: int = 2
    relay_events: int = 20_000
    pairs: int = 3

    @classmethod
    def quick(cls) -> ScalePlan:
        return cls(
            tenants=50,
            idle=(0, 200, 1_000),
            busy_endpoints=20,
            busy_tenants=5,
            deliveries=100,
            relay_events=100,
            pairs=1,  # the median of one pair takes the same path as of three
        )


def _engine(url: str) -> Engine:
    return create_engine(sqlalchemy_url(url))


def _sql(engine: Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(text(sql), params)


def build_idle_catalogue(engine: Engine, idle: int, tenants: int) -> None:
    """`tenants` tenants and `idle` endpoints over them with health rows; 20 more idle
    endpoints in the busy tenant, subscribed to types it never publishes."""
    _sql(
        engine,
        "INSERT INTO tenants (uid) SELECT 'tenant-' || g FROM generate_series(1, :n) AS g",
        n=tenants,
    )
    _sql(
        engine,
        """
        INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret)
        SELECT 'ep_idle_' || g, t.id, 'http://127.0.0.1:9/idle',
               CASE g % 3 WHEN 0 THEN ARRAY['*'] WHEN 1 THEN ARRAY['order.*']
                          ELSE ARRAY['invoice.paid'] END,
               'never-decrypted'
        FROM generate_series(1, :idle) AS g
        JOIN tenants t ON t.uid = 'tenant-' || (1 + g % :tenants)
        UNION ALL
        SELECT 'ep_idle_busy_' || g, t.id, 'http://127.0.0.1:9/idle', ARRAY['invoice.*'],
               'never-decrypted'
        FROM generate_series(1, 20) AS g, tenants t WHERE t.uid = :busy
        """,
        idle=idle,
        tenants=tenants,
        busy=BUSY_TENANT,
    )
    _sql(
        engine,
        """
        INSERT INTO endpoint_health (endpoint_id, max_in_flight)
        SELECT id, CASE WHEN id % 10 = 0 THEN 5 END FROM endpoints WHERE uid LIKE 'ep_idle%'
        """,
    )


def add_busy_endpoints(engine: Engine, box: SecretBox, count: int, tenants: int) -> list[int]:
    """`count` real endpoints (secrets the worker can decrypt) over `tenants` tenants."""
    uids = [f"ep_busy_{i}" for i in range(count)]
    secrets = [box.encrypt(generate_secret(), context=secret_context(uid)) for uid in uids]
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO tenants (uid)
                SELECT CASE WHEN g = 1 THEN :busy ELSE :busy || '-' || g END
                FROM generate_series(1, :tenants) AS g
                """
            ),
            {"busy": BUSY_TENANT, "tenants": tenants},
        )
        ids = conn.execute(
            text(
                """
                INSERT INTO endpoints (uid, tenant_id, url, event_types, signing_secret)
                SELECT u.uid, t.id, 'http://127.0.0.1:9/busy', ARRAY['order.*'], u.secret
                FROM unnest(CAST(:uids AS text[]), CAST(:secrets AS text[]))
                     WITH ORDINALITY AS u(uid, secret, n)
                JOIN tenants t ON t.uid = CASE WHEN (u.n - 1) % :tenants = 0 THEN :busy
                                               ELSE :busy || '-' || (1 + (u.n - 1) % :tenants)
                                          END
                ORDER BY u.n
                RETURNING id
                """
            ),
            {"uids": uids, "secrets": secrets, "tenants": tenants, "busy": BUSY_TENANT},
        ).scalars()
        return sorted(ids)


def add_due_deliveries(engine: Engine, endpoint_ids: list[int], count: int) -> None:
    """`count` relayed events, one due delivery each, round robin over the endpoints."""
    _sql(
        engine,
        """
        WITH ev AS (
            INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, relayed_at)
            SELECT 'msg_scale_' || g, e.tenant_id, 'order.created', CAST(:payload AS jsonb),
                   now()
            FROM generate_series(1, :count) AS g
            JOIN endpoints e ON e.id = (CAST(:ids AS bigint[]))[1 + g % :k]
            RETURNING id, tenant_id, message_id
        )
        INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, max_attempts,
                                next_attempt_at)
        SELECT ev.id, (CAST(:ids AS bigint[]))[1 + split_part(ev.message_id, '_', 3)::int % :k],
               ev.tenant_id, 'scheduled', 5, now() - interval '1 second'
        FROM ev
        """,
        count=count,
        ids=endpoint_ids,
        k=len(endpoint_ids),
        payload=json.dumps(PAYLOAD),
    )


def add_unrelayed_events(engine: Engine, count: int) -> None:
    _sql(
        engine,
        """
        INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
        SELECT 'msg_relay_' || g, (SELECT id FROM tenants WHERE uid = :busy), 'order.created',
               CAST(:payload AS jsonb)
        FROM generate_series(1, :count) AS g
        """,
        count=count,
        busy=BUSY_TENANT,
        payload=json.dumps(PAYLOAD),
    )


async def drain(url: str, key_setting: str, plan: ScalePlan, label: str) -> dict[str, Any]:
    _vacuum(url)
    done, began, ended = await claim_loops(
        url, key_setting, plan.batch_size, plan.loops, f"scale.{label}"
    )
    seconds = ended - began
    return {"deliveries": done, "seconds": round(seconds, 2), "per_s": round(done / seconds)}


async def relay_rate(url: str, plan: ScalePlan) -> dict[str, Any]:
    engine = _engine(url)
    add_unrelayed_events(engine, plan.relay_events)
    engine.dispose()
    _vacuum(url)
    async_engine = make_async_engine(url, pool_pre_ping=False)
    began = time.perf_counter()
    done = await Relay(async_engine, SystemClock(), RelayConfig()).run_until_idle()
    seconds = time.perf_counter() - began
    await async_engine.dispose()
    return {
        "events": done.events,
        "deliveries": done.deliveries,
        "seconds": round(seconds, 2),
        "delivery_rows_per_s": round(done.deliveries / seconds),
    }


async def measure(cluster: Cluster, plan: ScalePlan, progress: Any = None) -> dict[str, Any]:
    """Every scale figure, with the two ratios and their verdicts."""
    key_setting = generate_key("bench")
    box = SecretBox.from_setting(key_setting)
    results: dict[str, Any] = {"plan": asdict(plan), "idle": {}, "relay": {}}
    for idle in plan.idle:
        if progress:
            progress(f"scale: one busy endpoint beside {idle:,} idle ones")
        url = cluster.database_url(cluster.new_database(f"scale_idle_{idle}"))
        engine = _engine(url)
        busy = add_busy_endpoints(engine, box, 1, 1)
        if idle:
            build_idle_catalogue(engine, idle, plan.tenants)
        add_due_deliveries(engine, busy, plan.deliveries)
        endpoints = int(_scalar(engine, "SELECT count(*) FROM endpoints"))
        engine.dispose()
        results["idle"][str(idle)] = {
            "endpoints": endpoints,
            **await drain(url, key_setting, plan, f"idle{idle}"),
        }
        results["relay"][str(idle)] = {"endpoints": endpoints, **await relay_rate(url, plan)}
    # The busy ratio from adjacent pairs: one busy endpoint alone, then the same deliveries
    # over the busy endpoints, `pairs` times; the verdict takes the median of the pairs'
    # ratios. On a shared box the rates drift within a run (a third slower in its second
    # half was seen), and a pair measured back to back drifts least.
    pairs = []
    for index in range(plan.pairs):
        if progress:
            progress(f"scale: pair {index + 1} of {plan.pairs}: one busy endpoint alone")
        alone = await _drain_busy(cluster, box, key_setting, plan, 1, 1, "alone")
        if progress:
            progress(
                f"scale: pair {index + 1} of {plan.pairs}: {plan.busy_endpoints:,} busy "
                "endpoints sharing the deliveries"
            )
        many = await _drain_busy(
            cluster, box, key_setting, plan, plan.busy_endpoints, plan.busy_tenants, "many"
        )
        pairs.append(
            {"alone": alone, "many": many, "ratio": round(many["per_s"] / alone["per_s"], 2)}
        )
    results["pairs"] = pairs
    results["alone_again"] = pairs[0]["alone"]
    results["many_busy"] = {
        "endpoints": plan.busy_endpoints,
        "tenants": plan.busy_tenants,
        **pairs[0]["many"],
    }
    # The idle ratio's base: the better of the drain alone before the idle catalogues and
    # the one right after them (the first pair's), so an unlucky base cannot help it.
    none = max(results["idle"][str(plan.idle[0])]["per_s"], results["alone_again"]["per_s"])
    most = results["idle"][str(plan.idle[-1])]["per_s"]
    results["ratios"] = {
        "idle_max_over_none": round(most / none, 2),
        "many_busy_over_one": round(statistics.median(pair["ratio"] for pair in pairs), 2),
        "relay_max_over_none": round(
            results["relay"][str(plan.idle[-1])]["delivery_rows_per_s"]
            / results["relay"][str(plan.idle[0])]["delivery_rows_per_s"],
            2,
        ),
    }
    return results


async def _drain_busy(
    cluster: Cluster,
    box: SecretBox,
    key_setting: str,
    plan: ScalePlan,
    endpoints: int,
    tenants: int,
    label: str,
) -> dict[str, Any]:
    """Drain `plan.deliveries` spread over `endpoints` busy endpoints in `tenants`, in a
    fresh database with nothing else in it."""
    url = cluster.database_url(cluster.new_database(f"scale_{label}"))
    engine = _engine(url)
    busy = add_busy_endpoints(engine, box, endpoints, tenants)
    add_due_deliveries(engine, busy, plan.deliveries)
    engine.dispose()
    return await drain(url, key_setting, plan, label)


def _scalar(engine: Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def verdicts(scale: dict[str, Any]) -> list[list[str]]:
    """[target, measured, goal, verdict] rows for the two ratio targets of issue 10."""
    plan = scale["plan"]
    rows = []
    for name, key in (
        (f"drain with {plan['idle'][-1]:,} idle / with none", "idle_max_over_none"),
        (f"{plan['busy_endpoints']:,} busy endpoints / one busy", "many_busy_over_one"),
    ):
        value = scale["ratios"][key]
        met = value >= TARGET_RATIO
        gap = "met" if met else f"missed by {(TARGET_RATIO - value) / TARGET_RATIO:.0%}"
        rows.append([name, f"{value:g}", f">= {TARGET_RATIO:g}", gap])
    return rows


def report(scale: dict[str, Any]) -> list[str]:
    """Lines for the benchmark's printed report."""
    drains = ", ".join(f"{int(idle):,} idle: {r['per_s']}/s" for idle, r in scale["idle"].items())
    relays = ", ".join(
        f"{r['endpoints']:,} endpoints: {r['delivery_rows_per_s']} rows/s"
        for r in scale["relay"].values()
    )
    many = scale["many_busy"]
    return [
        f"scale (issue 10): drain to one busy endpoint (claim+record, batch "
        f"{scale['plan']['batch_size']}): {drains}, alone again {scale['alone_again']['per_s']}/s "
        f"(the better of the two 'alone' figures is the idle ratio's base); "
        f"{many['endpoints']:,} busy endpoints in {many['tenants']} tenants: "
        + ", ".join(
            f"{pair['many']['per_s']}/s against {pair['alone']['per_s']}/s alone just before "
            f"({pair['ratio']:g})"
            for pair in scale["pairs"]
        )
        + " (the median ratio is compared)",
        f"relay with the idle catalogue: {relays} "
        f"(ratio most/none {scale['ratios']['relay_max_over_none']})",
    ]
