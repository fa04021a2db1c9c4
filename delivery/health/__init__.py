"""Endpoint health: circuit breakers, per-endpoint limits, and the gate every claim passes.

One bad partner must never hurt the others. The state lives in `endpoint_health`
(one row per endpoint, created on first use), so every worker process shares it:

    closed --(N consecutive failures, or failure ratio over a window)--> open
    open --(cooldown passed: one probe claimed)--> half_open
    half_open --(probe answered)--> closed, then the backlog ramps up
    half_open --(probe failed)--> open again, with a longer cooldown (capped)

While open, an endpoint's deliveries are not claimed, so they spend no attempts.
After closing, its rate is capped by a ramp (start + step * seconds since closing)
until the ramp ends. A 429 pauses the endpoint (Retry-After, or a default) and
restarts the ramp from the end of the pause. An endpoint whose attempts have all
failed for `auto_disable_after` is disabled with a reason; its deliveries wait.

A claim first locks the health rows of *gated* endpoints (a breaker not closed,
limits set, a ramp or a pause running) with SKIP LOCKED: a second worker claiming
at the same moment skips those endpoints instead of overrunning their limits. The
limits count what is in flight in the database, so they hold across processes.

Outcomes update the rows in the transaction that records them, locked in id order.
The happy path writes nothing: the claim reports whether an endpoint is spotless
(closed, no failure in its window, no streak, no past trips), and answers from a
spotless endpoint change nothing, so the worker skips them. That is also why the
ratio window opens with a failure and counts the answers from then on.

The decisions are pure functions of a `Health` value, a clock reading and the
config (unit-tested without a database); the SQL only loads, locks and saves.
"""

from delivery.health.claims import (
    QUICK_WALK,
    Gates,
    Head,
    TenantCap,
    choose_endpoints,
    close_gates,
    earliest_opening,
    open_gates,
    tenant_after_claim,
    tenant_budget,
    tenant_next_opening,
)
from delivery.health.limits import (
    MAX_IN_FLIGHT,
    EndpointConcurrency,
    EndpointLimits,
    endpoint_health_report,
    get_endpoint_concurrency,
    get_endpoint_limits,
    set_endpoint_limits,
)
from delivery.health.rules import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    STATE_FIELDS,
    THROTTLE_STATUS,
    Health,
    HealthConfig,
    Observation,
    Summary,
    after_claim,
    after_outcomes,
    available_tokens,
    claim_budget,
    cooldown,
    disable_reason,
    effective_rate,
    good_news,
    is_failure,
    is_good_news,
    next_opening,
    summarize,
)
from delivery.health.store import (
    claimed_per_endpoint,
    ensure_health_rows,
    log_transition,
    record_observations,
    save,
)

__all__ = [
    "CLOSED",
    "HALF_OPEN",
    "MAX_IN_FLIGHT",
    "OPEN",
    "QUICK_WALK",
    "STATE_FIELDS",
    "THROTTLE_STATUS",
    "EndpointConcurrency",
    "EndpointLimits",
    "Gates",
    "Head",
    "Health",
    "HealthConfig",
    "Observation",
    "Summary",
    "TenantCap",
    "after_claim",
    "after_outcomes",
    "available_tokens",
    "choose_endpoints",
    "claim_budget",
    "claimed_per_endpoint",
    "close_gates",
    "cooldown",
    "disable_reason",
    "earliest_opening",
    "effective_rate",
    "endpoint_health_report",
    "ensure_health_rows",
    "get_endpoint_concurrency",
    "get_endpoint_limits",
    "good_news",
    "is_failure",
    "is_good_news",
    "log_transition",
    "next_opening",
    "open_gates",
    "record_observations",
    "save",
    "set_endpoint_limits",
    "summarize",
    "tenant_after_claim",
    "tenant_budget",
    "tenant_next_opening",
]
