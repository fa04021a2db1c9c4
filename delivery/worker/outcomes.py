"""The worker's attempts and outcomes: one POST, then rows written back under the fence."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import random
from collections.abc import Sequence

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from delivery import health, operational, queries
from delivery.http import AttemptResult, send_attempt
from delivery.policy import Decision, Outcome, decide, exhausted_reason
from delivery.worker.model import BatchStats, ClaimedDelivery, WorkerConfig, _iso
from outbox import direct, tracing
from outbox.clock import Clock
from outbox.direct import Statements

# The worker's one logger, named as before it became a package.
log = logging.getLogger("delivery.worker")


class Recording:
    """Attempting a claimed delivery and recording outcomes (`Worker` holds the state)."""

    _engine: AsyncEngine
    _http: httpx.AsyncClient
    _clock: Clock
    _rng: random.Random
    config: WorkerConfig
    _started: set[int]
    _health_rows: set[int]
    _outcomes_held: direct.HeldConnection | None

    # -- attempting and recording ---------------------------------------------------

    async def attempt(self, claimed: ClaimedDelivery) -> AttemptResult:
        span = tracing.start_attempt_span(
            claimed.traceparent,
            event_type=claimed.event_type,
            message_id=claimed.request.message_id,
            delivery_id=claimed.id,
            endpoint_uid=claimed.endpoint_uid,
            attempt=claimed.attempts + 1,
        )
        try:
            result = await send_attempt(
                self._http,
                claimed.request,
                self._clock,
                body_cap=self.config.response_body_cap,
                excerpt_bytes=self.config.response_excerpt_bytes,
                on_start=lambda: self._started.add(claimed.id),
            )
        except BaseException as exc:
            tracing.end_attempt_span(span, outcome="error", status_code=None, error=repr(exc))
            raise
        tracing.end_attempt_span(
            span, outcome=str(result.outcome), status_code=result.status_code, error=result.error
        )
        return result

    async def record(self, outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]]) -> BatchStats:
        """Write a batch of outcomes in one statement; returns what became of them."""
        stats = BatchStats()
        if not outcomes:
            return stats
        now = self._clock.now()
        decisions: list[Decision] = []
        # Successes of spotless endpoints change nothing: no health write on the happy path.
        observations: list[health.Observation] = []
        for claimed, result in outcomes:
            outcome = result.outcome
            if outcome is Outcome.SUCCEEDED:
                decisions.append(_SUCCEEDED)  # what `decide` says of every success
            elif _holds(claimed, result):
                # (decided all the same: the retry jitter draws stay as they were)
                self._decide(claimed, result, now)
                decisions.append(_held(claimed, result, now))
            else:
                decisions.append(self._decide(claimed, result, now))
            if claimed.endpoint_spotless and health.good_news(outcome, result.status_code):
                continue
            observations.append(
                health.Observation(
                    claimed.endpoint_id,
                    outcome,
                    result.status_code,
                    result.retry_after,
                    result.error,
                    result.duration_ms,
                )
            )
        await health.ensure_health_rows(
            self._engine, (item.endpoint_id for item in observations), self._health_rows
        )
        async with self._outcome_transaction(outcomes, decisions, observations) as conn:
            decisions = await self._explain_exhausted(conn, outcomes, decisions)
            kept, deleted = await self._write_outcome_rows(conn, now, outcomes, decisions)
            await operational.report_dead(
                conn,
                sorted(
                    claimed.id
                    for decision, (claimed, _) in zip(decisions, outcomes, strict=True)
                    if decision.state == "dead" and (claimed.id, claimed.claim) in kept
                ),
                now=now,
            )
            await operational.report_held(
                conn,
                sorted(
                    claimed.id
                    for decision, (claimed, _) in zip(decisions, outcomes, strict=True)
                    if decision.state == "held" and (claimed.id, claimed.claim) in kept
                ),
                now=now,
            )
            await self._disable_gone_endpoints(conn, now, outcomes)
            # Every attempt that happened informs its endpoint's breaker, kept or not.
            if observations:
                assert isinstance(conn, AsyncConnection)  # see _outcome_transaction
                await health.record_observations(
                    conn,
                    observations,
                    now=now,
                    config=self.config.health,
                    names={claimed.endpoint_id: claimed.endpoint_uid for claimed, _ in outcomes},
                )
        self._log_outcomes(outcomes, decisions, kept)
        lost = len(outcomes) - len(kept)
        if lost > deleted:
            log.warning(
                "%d outcomes arrived after their lease was rescued; kept as history",
                lost - deleted,
            )
        if deleted:
            log.warning(
                "%d outcomes were for deliveries deleted while their request was out (with "
                "their endpoint or event): not recorded",
                deleted,
            )
        stats.claimed = len(outcomes)
        stats.add(
            [
                d
                for d, (claimed, _) in zip(decisions, outcomes, strict=True)
                if (claimed.id, claimed.claim) in kept
            ],
            lost,
        )
        return stats

    def _decide(
        self, claimed: ClaimedDelivery, result: AttemptResult, now: dt.datetime
    ) -> Decision:
        return decide(
            result.outcome,
            attempts_made=claimed.attempts + 1,
            policy=claimed.policy,
            now=now,
            rng=self._rng,
            last_error=result.error or "",
            retry_after=result.retry_after,
            disables_endpoint=result.disables_endpoint,
        )

    def _outcome_transaction(
        self,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: Sequence[Decision],
        observations: Sequence[health.Observation],
    ) -> contextlib.AbstractAsyncContextManager[Statements]:
        """The record's transaction: on psycopg directly (outbox/direct.py) unless a
        breaker learns from it (its writes may audit an endpoint disabled, which takes
        SQLAlchemy). Only the outcome rows to write: one statement, committing by itself."""
        if observations:
            return self._engine.begin()
        only_rows = not any(
            d.exhausted or d.state in ("dead", "held") for d in decisions
        ) and not any(result.disables_endpoint for _, result in outcomes)
        # Within `run`, the connection its outcome writer holds while outcomes keep coming.
        return direct.transaction(self._engine, single=only_rows, held=self._outcomes_held)

    def _log_outcomes(
        self,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: Sequence[Decision],
        kept: set[tuple[int, int]],
    ) -> None:
        """One WARNING per delivery that became dead (the state change an operator acts
        on); each failed attempt that will be retried at DEBUG (the summary counts them)."""
        debug = log.isEnabledFor(logging.DEBUG)
        for (claimed, result), decision in zip(outcomes, decisions, strict=True):
            if (claimed.id, claimed.claim) not in kept:
                continue
            if decision.state == "scheduled" and debug:
                log.debug(
                    "delivery %d to endpoint %s, attempt %d failed (%s): %s; retry at %s",
                    claimed.id,
                    claimed.endpoint_uid,
                    claimed.attempts + 1,
                    result.outcome,
                    result.error or "no error text",
                    _iso(decision.next_attempt_at),
                )
            elif decision.state == "held":
                log.warning(
                    "delivery %d to endpoint %s is held for review (attempt %d): %s",
                    claimed.id,
                    claimed.endpoint_uid,
                    claimed.attempts + 1,
                    decision.final_reason,
                )
            elif decision.state == "dead":
                log.warning(
                    "delivery %d to endpoint %s is dead (attempt %d): %s",
                    claimed.id,
                    claimed.endpoint_uid,
                    claimed.attempts + 1,
                    decision.final_reason or "no reason recorded",
                )

    async def _explain_exhausted(
        self,
        conn: Statements,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: list[Decision],
    ) -> list[Decision]:
        """Give deliveries that used up their attempts a reason like '8 attempts over 17 h'."""
        exhausted = [
            claimed.id
            for decision, (claimed, _) in zip(decisions, outcomes, strict=True)
            if decision.exhausted
        ]
        if not exhausted:
            return decisions
        rows = await conn.execute(queries.SELECT_FIRST_ATTEMPT_TIMES, {"ids": exhausted})
        first_at = {int(row.delivery_id): row.first_at for row in rows}
        explained = []
        for decision, (claimed, result) in zip(decisions, outcomes, strict=True):
            if decision.exhausted:
                reason = exhausted_reason(
                    claimed.attempts + 1,
                    first_at.get(claimed.id, result.started_at),
                    result.started_at,
                    result.status_code,
                    result.error or "",
                )
                decision = Decision(decision.state, None, reason, exhausted=True)
            explained.append(decision)
        return explained

    async def _disable_gone_endpoints(
        self,
        conn: Statements,
        now: dt.datetime,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
    ) -> None:
        """410 Gone: disable the endpoint (with a reason) so its other deliveries wait."""
        gone = {
            claimed.endpoint_uid: claimed.request.url
            for claimed, result in outcomes
            if result.disables_endpoint
        }
        if not gone:
            return
        stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        reasons = [
            f"410 Gone from {url} at {stamp}: the receiver says this endpoint no longer "
            "exists; fix or delete it, then enable it to deliver what is waiting"
            for url in gone.values()
        ]
        disabled = (
            await conn.execute(
                queries.DISABLE_GONE_ENDPOINTS,
                {
                    "uids": list(gone),
                    "reasons": reasons,
                    "now": now,
                    "worker_id": self.config.worker_id,
                },
            )
        ).all()
        for row in disabled:
            log.warning("endpoint %s answered 410 Gone and was disabled", row.uid)

    async def _write_outcome_rows(
        self,
        conn: Statements,
        now: dt.datetime,
        outcomes: Sequence[tuple[ClaimedDelivery, AttemptResult]],
        decisions: Sequence[Decision],
    ) -> tuple[set[tuple[int, int]], int]:
        """One statement for the whole batch; returns the (id, claim) pairs still current
        and how many outcomes were for deliveries deleted meanwhile (nothing written)."""
        # One JSON document rather than thirteen arrays: the benchmark's profile put
        # psycopg's array packing at a quarter of the claim-and-record loop.
        rows = [
            {
                "id": claimed.id,
                "claim": claimed.claim,
                "state": decision.state,
                "attempts": claimed.attempts + 1,
                "next_attempt_at": _iso(decision.next_attempt_at),
                "status_code": result.status_code,
                "error": result.error,
                "final_reason": decision.final_reason,
                "started_at": result.started_at.isoformat(),
                "duration_ms": result.duration_ms,
                "outcome": str(result.outcome),
                "response_excerpt": result.response_excerpt,
                # Already without secrets: custom header values are redacted at the source.
                "request_headers": result.request_headers,
            }
            for (claimed, result), decision in zip(outcomes, decisions, strict=True)
        ]
        params = {
            "now": now,
            "worker_id": self.config.worker_id,
            "outcomes": _ROWS_JSON.encode(rows),
        }
        written = (await conn.execute(queries.RECORD_OUTCOMES, params)).all()
        kept = {(row.id, row.claims) for row in written if row.claims is not None}
        return kept, len(written) - len(kept)

    async def release(self, claims: Sequence[ClaimedDelivery]) -> int:
        """Hand claims back without spending an attempt (used at shutdown)."""
        if not claims:
            return 0
        async with self._engine.begin() as conn:
            released = (
                await conn.execute(
                    queries.RELEASE_CLAIMS,
                    {
                        "ids": [item.id for item in claims],
                        "claims": [item.claim for item in claims],
                        "worker_id": self.config.worker_id,
                        "now": self._clock.now(),
                    },
                )
            ).all()
        return len(released)


# What `decide` says of every success (Decision is frozen: one will do for all).
_SUCCEEDED = Decision("succeeded", None, None)
# The outcome rows' document: compact, and without the cycle check (plain rows built
# just above, nothing in them refers back).
_ROWS_JSON = json.JSONEncoder(check_circular=False, separators=(",", ":"))


def _holds(claimed: ClaimedDelivery, result: AttemptResult) -> bool:
    """An ambiguous outcome (the request went out, no answer) where the endpoint or the
    event type asks for a person to decide instead of a retry."""
    return claimed.hold_ambiguous and result.outcome == Outcome.AMBIGUOUS


def _held(claimed: ClaimedDelivery, result: AttemptResult, now: dt.datetime) -> Decision:
    """Held: neither rescheduled nor dead; it waits for confirm, send again or discard.
    It holds even when its attempts are used up: whether it arrived is for a person."""
    stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Decision(
        "held",
        None,
        f"held for review at {stamp} after attempt {claimed.attempts + 1} "
        f"({result.error or 'sent, no answer: it may have arrived'}): "
        "confirm it delivered, send it again or discard it",
    )
