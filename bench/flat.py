"""Flat cost as the tables grow (issue 11): relay, claim and outcome writes, empty vs grown.

Two databases with the same measured work: relay `flat_events` new events (fan-out
1), then claim and record the deliveries that made (the worker's own statements,
HTTP replaced by success, as in claim-and-complete). One database is empty; the
other first gets, on the same endpoint:

- a **backlog** of `flat_backlog` scheduled deliveries due tomorrow (waiting for
  retries: the due index holds them, no claim may take them);
- a **history** of `flat_history` relayed events, each with one succeeded delivery
  and one attempt row (what retention has not pruned yet).

The rows are built with generate_series in SQL and analysed before measuring. The
measured rounds alternate between the two databases (`flat_rounds` each; the best
round of each side counts). The row is the slowdown (empty rate / grown rate) of
each step; the target is at most 1.2 (no more than 20 % slower).
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import create_engine, text

from bench.cluster import EVENT_TYPE, PAYLOAD, Cluster, Plan
from bench.components import _vacuum, claim_loops
from outbox.clock import SystemClock
from outbox.crypto import SecretBox, generate_key
from outbox.db import make_async_engine, sqlalchemy_url
from outbox.endpoints import create_endpoint
from outbox.relay import Relay, RelayConfig

TARGET = 1.2

_HISTORY = [
    """
    INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, created_at, relayed_at)
    SELECT 'msg_hist_' || g, :tenant, :event_type, CAST(:payload AS jsonb),
           now() - interval '2 days', now() - interval '2 days'
    FROM generate_series(1, :history) AS g
    """,
    """
    INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, attempts, max_attempts,
                            next_attempt_at, last_status_code, created_at, updated_at,
                            completed_at)
    SELECT e.id, :endpoint, :tenant, 'succeeded', 1, 8, e.created_at, 200, e.created_at,
           e.created_at, e.created_at
    FROM outbox_events e WHERE e.message_id LIKE 'msg\\_hist\\_%'
    """,
    """
    INSERT INTO delivery_attempts (delivery_id, attempt_number, started_at, duration_ms,
                                   status_code, outcome, request_headers, worker_id)
    SELECT d.id, 1, d.created_at, 12, 200, 'succeeded', '{"webhook-id": "x"}', 'bench.history'
    FROM deliveries d WHERE d.state = 'succeeded'
    """,
]

_BACKLOG = [
    """
    INSERT INTO outbox_events (message_id, tenant_id, event_type, payload, relayed_at)
    SELECT 'msg_wait_' || g, :tenant, :event_type, CAST(:payload AS jsonb), now()
    FROM generate_series(1, :backlog) AS g
    """,
    """
    INSERT INTO deliveries (event_id, endpoint_id, tenant_id, state, attempts, max_attempts,
                            next_attempt_at, last_status_code, last_error)
    SELECT e.id, :endpoint, :tenant, 'scheduled', 1, 8, now() + interval '1 day', 503,
           'HTTP 503 Service Unavailable'
    FROM outbox_events e WHERE e.message_id LIKE 'msg\\_wait\\_%'
    """,
]


def _build(url: str, box: SecretBox, *, backlog: int, history: int) -> dict[str, float]:
    """One endpoint, and the grown rows if asked; returns seconds spent building."""
    engine = create_engine(sqlalchemy_url(url))
    began = time.perf_counter()
    with engine.begin() as conn:
        endpoint = create_endpoint(
            conn, box, url="http://127.0.0.1:9/unused", event_types="*", concurrency="fixed"
        )
        ids = conn.execute(
            text("SELECT id, tenant_id FROM endpoints WHERE uid = :uid"),
            {"uid": endpoint.endpoint.uid},
        ).one()
    params = {
        "endpoint": ids.id,
        "tenant": ids.tenant_id,
        "event_type": EVENT_TYPE,
        "payload": json.dumps(PAYLOAD),
        "history": history,
        "backlog": backlog,
    }
    for statement in (_HISTORY if history else []) + (_BACKLOG if backlog else []):
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    engine.dispose()
    _vacuum(url)
    return {"build_seconds": round(time.perf_counter() - began, 1)}


def _add_events(url: str, count: int, label: str) -> None:
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO outbox_events (message_id, tenant_id, event_type, payload)
                SELECT 'msg_new_' || :label || '_' || g,
                       (SELECT id FROM tenants WHERE uid = 'default'),
                       :event_type, CAST(:payload AS jsonb)
                FROM generate_series(1, :count) AS g
                """
            ),
            {
                "event_type": EVENT_TYPE,
                "payload": json.dumps(PAYLOAD),
                "count": count,
                "label": label,
            },
        )
    engine.dispose()


async def _round(
    url: str, key_setting: str, plan: Plan, label: str
) -> tuple[int, float, int, float]:
    """Relay `flat_events` new events, then claim and record them:
    (rows relayed, relay rows/s, deliveries recorded, claims/s)."""
    _add_events(url, plan.flat_events, label)
    engine = make_async_engine(url, pool_pre_ping=False)
    began = time.perf_counter()
    relayed = await Relay(engine, SystemClock(), RelayConfig()).run_until_idle()
    relay_seconds = time.perf_counter() - began
    await engine.dispose()
    done, start, end = await claim_loops(url, key_setting, 500, plan.claim_loops, "bench.flat")
    return (
        relayed.deliveries,
        relayed.deliveries / relay_seconds,
        done,
        done / (end - start) if done else 0.0,
    )


async def flat_cost(cluster: Cluster, plan: Plan) -> dict[str, Any]:
    """Build both databases, then alternate the measured rounds between them (the box is
    shared: alternating lets the same background load hit both), best round of each."""
    sides: dict[str, dict[str, Any]] = {}
    for label, grown in (("empty", False), ("grown", True)):
        database = cluster.new_database(f"flat_{label}")
        url = cluster.database_url(database)
        key_setting = generate_key("bench")
        built = _build(
            url,
            SecretBox.from_setting(key_setting),
            backlog=plan.flat_backlog if grown else 0,
            history=plan.flat_history if grown else 0,
        )
        sides[label] = {
            "url": url,
            "key": key_setting,
            **built,
            "backlog": plan.flat_backlog if grown else 0,
            "history": plan.flat_history if grown else 0,
            "relay_rounds": [],
            "claim_rounds": [],
            "relayed": 0,
            "claimed_and_recorded": 0,
        }
    for index in range(plan.flat_rounds):
        for label, side in sides.items():
            relayed, relay_rate, done, claim_rate = await _round(
                side["url"], side["key"], plan, f"{label}{index}"
            )
            side["relayed"] += relayed
            side["claimed_and_recorded"] += done
            side["relay_rounds"].append(round(relay_rate))
            side["claim_rounds"].append(round(claim_rate))
    results: dict[str, Any] = {}
    for label, side in sides.items():
        results[label] = {
            key: value for key, value in side.items() if key not in ("url", "key")
        } | {
            "relay_rows_per_s": max(side["relay_rounds"]),
            "claim_complete_per_s": max(side["claim_rounds"]),
        }
    empty, grown_ = results["empty"], results["grown"]
    slowdown = {
        "relay": round(empty["relay_rows_per_s"] / max(grown_["relay_rows_per_s"], 1), 3),
        "claim_complete": round(
            empty["claim_complete_per_s"] / max(grown_["claim_complete_per_s"], 1), 3
        ),
    }
    return {
        **results,
        "rounds": plan.flat_rounds,
        "slowdown": slowdown,
        "worst_slowdown": max(slowdown.values()),
        "target": TARGET,
    }
