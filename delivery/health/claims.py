"""The gate every claim passes: endpoint and tenant budgets, locked, and the endpoints to visit."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from delivery import queries
from delivery.health.rules import (
    Health,
    HealthConfig,
    after_claim,
    available_tokens,
    claim_budget,
    in_flight_limit,
    next_opening,
)
from delivery.health.store import save
from outbox.direct import Statements


@dataclass(frozen=True, slots=True)
class TenantCap:
    """A capped tenant's limits and token bucket, as one claim saw them (locked)."""

    tenant_id: int
    max_in_flight: int | None = None
    max_per_second: float | None = None
    tokens: float | None = None
    tokens_at: dt.datetime | None = None


def tenant_budget(cap: TenantCap, *, in_flight: int, now: dt.datetime) -> int | None:
    """How many of this tenant's deliveries one claim may take now, across its endpoints."""
    budget = math.inf
    if cap.max_in_flight is not None:
        budget = max(0, cap.max_in_flight - in_flight)
    if cap.max_per_second is not None:
        bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
        budget = min(budget, math.floor(available_tokens(bucket, now, cap.max_per_second)))
    return None if budget == math.inf else int(budget)


def tenant_after_claim(cap: TenantCap, claimed: int, *, now: dt.datetime) -> TenantCap:
    """The bucket after a claim took `claimed` of the tenant's deliveries."""
    if cap.max_per_second is None:
        return cap
    bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
    tokens = available_tokens(bucket, now, cap.max_per_second) - claimed
    return dataclasses.replace(cap, tokens=tokens, tokens_at=now)


def tenant_next_opening(cap: TenantCap, *, now: dt.datetime) -> dt.datetime | None:
    """When a tenant capped per second may take one more, if its bucket alone holds it
    back (None: no rate cap, or a token is there: an in-flight cap waits for an outcome)."""
    if cap.max_per_second is None:
        return None
    bucket = Health(0, tokens=cap.tokens, tokens_at=cap.tokens_at)
    tokens = available_tokens(bucket, now, cap.max_per_second)
    if tokens >= 1:
        return None
    return now + dt.timedelta(seconds=(1 - tokens) / cap.max_per_second)


@dataclass(frozen=True, slots=True)
class Head:
    """An endpoint's first due delivery in claim order, as the gates saw it."""

    endpoint_id: int
    tenant_id: int
    priority: int
    due_at: dt.datetime
    delivery_id: int


def choose_endpoints(
    heads: Sequence[Head],
    budgets: Mapping[int, int],
    tenant_budgets: Mapping[int, int],
    limit: int,
    set_aside: Collection[int] = frozenset(),
) -> tuple[list[int], bool]:
    """The endpoints one claim visits: at most `limit`, in the claim's own order, so the
    claim's cost follows its batch size, not the number of endpoints with due work; and
    whether more endpoints were eligible than chosen.

    The order is the claim's: priority first, then round robin across tenants (each
    tenant's endpoints take turns by their heads' age), then the oldest head. An endpoint
    served by this claim moves its head to a newer row, so the next claim rotates on to
    the endpoints that waited. Endpoints or tenants with no budget left are not visited.
    `set_aside` endpoints (a recent visit found nothing claimable: per-key ordering held
    every due row) come last, so stuck endpoints never crowd out the others.
    """
    eligible = [
        h
        for h in heads
        if budgets.get(h.endpoint_id, 1) > 0 and tenant_budgets.get(h.tenant_id, 1) > 0
    ]
    eligible.sort(key=lambda h: (h.tenant_id, -h.priority, h.due_at, h.delivery_id))
    turns: Counter[tuple[int, int]] = Counter()
    turn: dict[int, int] = {}
    for head in eligible:
        turns[head.tenant_id, head.priority] += 1
        turn[head.endpoint_id] = turns[head.tenant_id, head.priority]
    eligible.sort(
        key=lambda h: (
            h.endpoint_id in set_aside,
            -h.priority,
            turn[h.endpoint_id],
            h.due_at,
            h.delivery_id,
        )
    )
    return [h.endpoint_id for h in eligible[:limit]], len(eligible) > limit


# The quick path walks this many due rows per endpoint of the batch, at most: enough to
# meet a batch's worth of tenants when their due rows are interleaved, even unevenly.
QUICK_WALK = 4


@dataclass(frozen=True, slots=True)
class Gates:
    """What one claim may take: the heads of the endpoints with due work (enabled, of
    enabled tenants), budgets of gated endpoints and capped tenants (others: unlimited).

    On the quick path (`open_gates` with a limit), `batch` holds the chosen endpoints,
    their gated ones locked (`locked`, `budgets`), and `heads` nothing; otherwise `heads`
    holds every candidate."""

    budgets: dict[int, int]
    locked: dict[int, Health]
    heads: list[Head] = dataclasses.field(default_factory=list)
    tenant_budgets: dict[int, int] = dataclasses.field(default_factory=dict)
    tenants_locked: dict[int, TenantCap] = dataclasses.field(default_factory=dict)
    tenant_of: dict[int, int] = dataclasses.field(default_factory=dict)
    more: bool = False  # eligible endpoints were left out of `heads` (quick: maybe)
    spread: int = 0  # tenants with due work, at least (whether the quick path may apply)
    path: str = "all"  # "quick": QUICK_CLAIM_GATES found the batch; "all": every candidate
    batch: list[int] | None = None  # the quick path's batch, in claim order (no `heads`)
    # A gate row (endpoint health or tenant) of due work was held by another worker, so
    # this claim took nothing of it: that worker lets go within a statement or two.
    held_elsewhere: bool = False

    def params(
        self,
        limit: int,
        local_caps: Mapping[int, int] | None = None,
        set_aside: Collection[int] = frozenset(),
    ) -> dict[str, Any]:
        """Claim parameters; `local_caps` lowers budgets further (this worker's slot share).
        `more` (not a statement parameter) says whether eligible endpoints were left out."""
        budgets = dict(self.budgets)
        for endpoint_id, cap in (local_caps or {}).items():
            budgets[endpoint_id] = min(budgets.get(endpoint_id, cap), cap)
        if self.batch is not None:
            # QUICK_CLAIM_GATES chose it as choose_endpoints would (without the endpoints
            # this worker has no slot for), so nothing was left out of it
            chosen, more = self.batch[:limit], False
        else:
            chosen, more = choose_endpoints(
                self.heads, budgets, self.tenant_budgets, limit, set_aside
            )
        more = more or self.more
        # About twice each endpoint's fair share of the batch: enough to fill it when some
        # endpoints have less due, few enough that many busy endpoints lock few rows each.
        per_endpoint = max(1, math.ceil(2 * limit / max(1, len(chosen))))
        return {
            "more": more,
            "endpoint_ids": chosen,
            "per_endpoint": per_endpoint,
            "gate_ids": list(budgets),
            "gate_budgets": list(budgets.values()),
            "tenant_gate_ids": list(self.tenant_budgets),
            "tenant_gate_budgets": list(self.tenant_budgets.values()),
        }


async def open_gates(
    conn: Statements,
    *,
    now: dt.datetime,
    config: HealthConfig,
    limit: int | None = None,
    set_aside: Collection[int] = frozenset(),
    local_caps: Mapping[int, int] | None = None,
    quick: bool = True,
) -> Gates:
    """Find the endpoints with scheduled work; lock the gated endpoints' health rows and the
    capped tenants' rows (SKIP LOCKED) and work out each one's claim budget.

    An endpoint or tenant whose row another worker holds gets budget 0 for this claim:
    that worker is spending its limits right now.

    With a `limit` (and the `set_aside` and `local_caps` that `Gates.params` will get),
    it first tries to find the claim's batch from the oldest due rows alone
    (queries.QUICK_CLAIM_GATES): when that applies, `batch` holds the same endpoints
    `choose_endpoints` would pick from every candidate (and `heads` nothing), read at the cost
    of a batch rather than of every endpoint with due work. Worth trying while a batch's
    worth of tenants have work (the last claim's `spread`): `quick` says whether to try.
    """
    if quick and limit is not None and limit > 0:
        gates = await _quick_gates(
            conn, now=now, config=config, limit=limit, set_aside=set_aside, local_caps=local_caps
        )
        if gates is not None:
            return gates
    budgets: dict[int, int] = {}
    locked: dict[int, Health] = {}
    heads: list[Head] = []
    locked_ids: list[int] = []
    tenant_budgets: dict[int, int] = {}
    tenants_locked: dict[int, TenantCap] = {}
    tenant_of: dict[int, int] = {}
    held_elsewhere = False
    for row in await conn.execute(queries.LOCK_CLAIM_GATES, {"now": now}):
        heads.append(
            Head(row.endpoint_id, row.tenant_id, row.head_priority, row.head_due_at, row.head_id)
        )
        tenant_of[row.endpoint_id] = row.tenant_id
        if row.gated:
            if row.locked:
                locked_ids.append(row.endpoint_id)
            else:
                budgets[row.endpoint_id] = 0
                held_elsewhere = True
        if row.tenant_capped:
            if row.tenant_locked:
                tenants_locked[row.tenant_id] = TenantCap(
                    row.tenant_id,
                    row.tenant_max_in_flight,
                    row.tenant_max_per_second,
                    row.tenant_tokens,
                    row.tenant_tokens_at,
                )
            else:
                tenant_budgets[row.tenant_id] = 0
                held_elsewhere = True
    if locked_ids:
        result = await conn.execute(queries.SELECT_LOCKED_HEALTH, {"ids": locked_ids})
        locked = {row.endpoint_id: Health.from_row(row) for row in result}
    budgets.update(await _budgets(conn, locked, now=now, config=config))
    tenant_in_flight: dict[int, int] = {}
    counted = [c.tenant_id for c in tenants_locked.values() if c.max_in_flight is not None]
    if counted:
        result = await conn.execute(queries.COUNT_TENANT_IN_FLIGHT, {"ids": counted})
        tenant_in_flight = {row.tenant_id: int(row.in_flight) for row in result}
    for tenant_id, cap in tenants_locked.items():
        tenant_cap = tenant_budget(cap, in_flight=tenant_in_flight.get(tenant_id, 0), now=now)
        if tenant_cap is not None:
            tenant_budgets[tenant_id] = tenant_cap
    return Gates(
        budgets=budgets,
        locked=locked,
        heads=heads,
        tenant_budgets=tenant_budgets,
        tenants_locked=tenants_locked,
        tenant_of=tenant_of,
        spread=len(set(tenant_of.values())),
        held_elsewhere=held_elsewhere,
    )


# How many times the quick path looks again, leaving out the gated endpoints it found
# without budget (another worker holds the row, or the limit is reached), before it
# falls back to every candidate: two workers claiming at once find the same oldest
# endpoints, and the second one moves on to the next instead of reading them all.
QUICK_TRIES = 3


async def _quick_gates(
    conn: Statements,
    *,
    now: dt.datetime,
    config: HealthConfig,
    limit: int,
    set_aside: Collection[int],
    local_caps: Mapping[int, int] | None,
) -> Gates | None:
    """The claim's batch from queries.QUICK_CLAIM_GATES, or None when it cannot tell.

    Gated endpoints in the batch get their rows locked and their budgets worked out here.
    One without budget is left out of the walk and the batch is looked for again, as the
    walk already leaves out the endpoints whose slots this worker has used up: either
    way choose_endpoints would not visit it, and the next endpoint takes its turn."""
    excluded = {eid for eid, cap in (local_caps or {}).items() if cap <= 0}
    budgets: dict[int, int] = {}
    locked: dict[int, Health] = {}
    held: set[int] = set()
    for _ in range(QUICK_TRIES):
        row = (
            await conn.execute(
                queries.QUICK_CLAIM_GATES,
                {
                    "now": now,
                    "limit": limit,
                    "walk": QUICK_WALK * limit,
                    "set_aside": list(set_aside),
                    "excluded": list(excluded),
                },
            )
        ).one()
        batch: list[int] = row.endpoint_ids or []
        if len(batch) < limit or not row.plain_or_gated:
            return None
        if row.plain:
            break
        refused = await _lock_gated(
            conn, row.gated_ids, budgets, locked, held, now=now, config=config
        )
        if not refused:
            break
        excluded |= refused
    else:
        return None
    return Gates(
        budgets=budgets,
        locked=locked,
        tenant_of=dict(zip(batch, row.tenant_ids, strict=True)),
        # more due rows at this priority than the batch took, or work at a lower one
        more=row.walked > limit or row.lower,
        spread=row.spread,
        path="quick",
        batch=batch,
        held_elsewhere=bool(held),
    )


async def _lock_gated(
    conn: Statements,
    ids: Sequence[int],
    budgets: dict[int, int],
    locked: dict[int, Health],
    held: set[int],
    *,
    now: dt.datetime,
    config: HealthConfig,
) -> set[int]:
    """Lock the quick batch's gated health rows (SKIP LOCKED, like LOCK_CLAIM_GATES) and
    put their budgets in `budgets`; returns the endpoints without budget: their row is
    held by another worker (budget 0, as on the full path; also added to `held`) or
    their limit is reached."""
    result = await conn.execute(queries.LOCK_GATED_HEALTH, {"ids": list(ids)})
    fresh = {row.endpoint_id: Health.from_row(row) for row in result}
    locked.update(fresh)
    refused = {eid for eid in ids if eid not in fresh}
    held |= refused
    for endpoint_id in refused:
        budgets[endpoint_id] = 0
    found = await _budgets(conn, fresh, now=now, config=config)
    budgets.update(found)
    refused.update(eid for eid, budget in found.items() if budget <= 0)
    return refused


async def _budgets(
    conn: Statements, healths: Mapping[int, Health], *, now: dt.datetime, config: HealthConfig
) -> dict[int, int]:
    """The claim budget of each gated endpoint among `healths` (by endpoint id), from its
    health row and its deliveries in flight, counted only where an in-flight limit needs
    them; an endpoint without a gate has none."""
    counted = [eid for eid, h in healths.items() if in_flight_limit(h, config) is not None]
    in_flight: dict[int, int] = {}
    if counted:
        result = await conn.execute(queries.COUNT_IN_FLIGHT, {"ids": counted})
        in_flight = {row.endpoint_id: int(row.in_flight) for row in result}
    found: dict[int, int] = {}
    for endpoint_id, health in healths.items():
        budget = claim_budget(
            health, in_flight=in_flight.get(endpoint_id, 0), now=now, config=config
        )
        if budget is not None:
            found[endpoint_id] = budget
    return found


async def close_gates(
    conn: Statements,
    gates: Gates,
    claimed: Mapping[int, int],
    *,
    now: dt.datetime,
    config: HealthConfig,
) -> dt.datetime | None:
    """Charge what the claim took to the locked rows (tokens, probe), in the claim's transaction.

    Returns the earliest moment one of these endpoints' or tenants' gates opens again by
    itself (a pause or cooldown ending, a token refilling), so the worker can claim then
    instead of at its next poll.
    """
    changed = []
    openings = []
    for endpoint_id, health in gates.locked.items():
        updated = after_claim(health, claimed.get(endpoint_id, 0), now=now, config=config)
        if updated != health:
            changed.append(updated)
        opening = next_opening(updated, now=now, config=config)
        if opening is not None:
            openings.append(opening)
    await save(conn, changed, now=now)
    per_tenant: Counter[int] = Counter()
    for endpoint_id, count in claimed.items():
        per_tenant[gates.tenant_of.get(endpoint_id, 0)] += count
    buckets = [
        tenant_after_claim(cap, per_tenant[tenant_id], now=now)
        for tenant_id, cap in gates.tenants_locked.items()
        if cap.max_per_second is not None
    ]
    openings += [at for b in buckets if (at := tenant_next_opening(b, now=now)) is not None]
    if buckets:
        await conn.execute(
            queries.SAVE_TENANT_BUCKETS,
            {
                "tenant_ids": [b.tenant_id for b in buckets],
                "tokens": [b.tokens for b in buckets],
                "tokens_at": [b.tokens_at for b in buckets],
            },
        )
    return min(openings, default=None)


def earliest_opening(gates: Gates, *, now: dt.datetime, config: HealthConfig) -> dt.datetime | None:
    """`close_gates`' answer for a claim that took nothing, without writing anything."""
    openings = [
        opening
        for health in gates.locked.values()
        if (
            opening := next_opening(
                after_claim(health, 0, now=now, config=config), now=now, config=config
            )
        )
        is not None
    ]
    openings += [
        at
        for cap in gates.tenants_locked.values()
        if (at := tenant_next_opening(cap, now=now)) is not None
    ]
    return min(openings, default=None)
