"""The worker's claiming: due deliveries within each endpoint's breaker and limits."""

from __future__ import annotations

import collections
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy.ext.asyncio import AsyncEngine

from delivery import health, queries
from delivery.http import OutgoingRequest
from delivery.policy import Outcome, RetryPolicy, matching_rule, parse_status_overrides
from delivery.worker.model import (
    _NO_HEADERS,
    _NO_OVERRIDES,
    BARREN_FOR,
    ClaimedDelivery,
    WorkerConfig,
    _envelope,
    _memo,
)
from outbox import direct
from outbox.clock import Clock
from outbox.crypto import SecretBox, SigningKey, signing_key
from outbox.endpoint_auth import (
    ClientCertificate,
    OAuthClient,
    decrypt_client_certificate,
    decrypt_oauth_client,
)
from outbox.endpoints import decrypt_proxy, secret_context
from outbox.headers import decrypt_headers

# A claim that found a gate row of due work held by another worker looks again this
# soon (the run loop waits at least its claim_gather): the holder's claim or outcome
# write lets go within milliseconds, and waiting for the poll (a second) left a second
# worker on one busy adaptive endpoint idle for most of a drain.
HELD_ELSEWHERE_RETRY = dt.timedelta(milliseconds=10)


class Claiming:
    """Claims and what each claimed row needs to be sent (`Worker` holds the state)."""

    _engine: AsyncEngine
    _box: SecretBox
    _clock: Clock
    config: WorkerConfig
    _keys: dict[str, SigningKey]
    _headers: dict[str, dict[str, str]]
    _proxies: dict[str, str]
    _client_certificates: dict[str, ClientCertificate]
    _oauth_clients: dict[str, OAuthClient]
    _policies: dict[tuple[tuple[float, ...] | None, str, int], RetryPolicy]
    _type_json: dict[str, str]
    _slots_held: collections.Counter[int]
    _gated: frozenset[int]
    _capped: frozenset[int]
    _opening: dt.datetime | None
    next_gate_at: dt.datetime | None
    claims: int
    _barren: dict[int, dt.datetime]
    _spread: int
    gate_paths: collections.Counter[str]
    # Whether the last claim found the gates with nothing to say, so the next one tries
    # them folded into the claim (queries.CLAIM_FOLDED); the first claim goes through them.
    _plain: bool = False
    # The last claim took a full batch only from endpoints whose share of this worker's
    # slots it used up, and left none out: claiming again at once would find nothing
    # more (new work notifies; `run` waits for that, or for a slot, instead).
    saturated: bool = False
    _round_saturated: bool = False

    # -- claiming -------------------------------------------------------------------

    async def claim(self, limit: int) -> list[ClaimedDelivery]:
        """Claim up to `limit` due deliveries, within each endpoint's breaker and limits.

        A claim visits at most `limit` endpoints. When some of them had nothing claimable
        (per-key ordering held every due row) and other endpoints were left out, it claims
        again at once with those set aside, so stuck endpoints cannot starve the rest.
        """
        claimed: list[ClaimedDelivery] = []
        # The rounds' earliest gate opening; `next_gate_at` changes once, when the claim is
        # over (whoever reads it meanwhile sees the last claim's answer), and a failed claim
        # leaves no stale wake-up behind.
        self._opening = None
        self.saturated = False
        rounds = 0
        try:
            while rounds < 3:
                rounds += 1
                found, retry = await self._claim_round(limit - len(claimed))
                claimed += found
                if len(claimed) >= limit or not retry:
                    break
        finally:
            self.next_gate_at = self._opening
        # (after several rounds `_capped` holds the last one's endpoints only)
        self.saturated = rounds == 1 and self._round_saturated
        return claimed

    async def _claim_round(self, limit: int) -> tuple[list[ClaimedDelivery], bool]:
        now = self._clock.now()
        self.claims += 1
        self._round_saturated = False
        self._barren = {eid: until for eid, until in self._barren.items() if until > now}
        local = self._slots_left()
        if self._plain:
            folded = await self._claim_folded(limit, now, local)
            if folded is not None:
                return folded, False
        # On psycopg directly (outbox/direct.py): the claim is the worker's hot path.
        async with direct.transaction(self._engine) as conn:
            gates = await health.open_gates(
                conn,
                now=now,
                config=self.config.health,
                limit=limit,
                set_aside=self._barren.keys(),
                local_caps=local,
                quick=self._spread >= limit,
            )
            self._spread = gates.spread
            self.gate_paths[gates.path] += 1
            params = gates.params(limit, local, self._barren.keys())
            more = params.pop("more")
            # Gates with nothing to say (no health gate, no tenant cap, every endpoint
            # with due work fits one claim): the next claim tries them folded into it.
            self._plain = (
                gates.path == "all"
                and not gates.locked
                and not gates.budgets
                and not gates.tenant_budgets
                and not gates.tenants_locked
                and len(gates.heads) <= limit
            )
            if gates.held_elsewhere:
                # Another worker held a gate row of due work (its claim or outcome write
                # on a busy gated endpoint): look again once it has let go, not at the poll.
                self._note_gate_opening(now + HELD_ELSEWHERE_RETRY)
            if not params["endpoint_ids"]:
                # Nothing due (or all held: disabled tenants, no budget left).
                self._note_gates(gates, local, {})
                self._note_gate_opening(
                    health.earliest_opening(gates, now=now, config=self.config.health)
                )
                return [], False
            rows = (
                await conn.execute(
                    queries.CLAIM_DUE_DELIVERIES,
                    {
                        "now": now,
                        "limit": limit,
                        "worker_id": self.config.worker_id,
                        "lease_expires_at": now + dt.timedelta(seconds=self.config.lease_seconds),
                        **params,
                    },
                )
            ).all()
            taken = health.claimed_per_endpoint(row.endpoint_id for row in rows)
            self._note_gate_opening(
                await health.close_gates(conn, gates, taken, now=now, config=self.config.health)
            )
        self._note_gates(gates, local, taken)
        self._note_saturated(taken, more=more)
        served = {row.endpoint_id for row in rows}
        barren = [eid for eid in params["endpoint_ids"] if eid not in served]
        for endpoint_id in barren:
            self._barren[endpoint_id] = now + BARREN_FOR
        return self._prepare_all(rows, now), bool(barren) and more

    async def _claim_folded(
        self, limit: int, now: dt.datetime, local: Mapping[int, int]
    ) -> list[ClaimedDelivery] | None:
        """The claim with the gates folded in (queries.CLAIM_FOLDED): one statement, on
        its generic plan (planned once per connection, not on every claim). None when
        the gates have something to say after all (a health gate, a tenant cap, more
        endpoints with due work than one claim visits): it claimed nothing then, and the
        claim goes through the gates."""
        async with direct.transaction(self._engine, generic_plans=True) as conn:
            rows = await conn.execute(
                queries.CLAIM_FOLDED,
                {
                    "now": now,
                    "limit": limit,
                    "worker_id": self.config.worker_id,
                    "lease_expires_at": now + dt.timedelta(seconds=self.config.lease_seconds),
                    "gate_ids": list(local),
                    "gate_budgets": list(local.values()),
                    "tenant_gate_ids": [],
                    "tenant_gate_budgets": [],
                },
            )
        verdict = rows[0]
        self._plain = verdict.gates_plain
        if not verdict.gates_plain:
            return None
        self._spread = verdict.gates_spread
        self.gate_paths["folded"] += 1
        claimed = [row for row in rows if row.id is not None]
        taken = health.claimed_per_endpoint(row.endpoint_id for row in claimed)
        self._note_gates(health.Gates(budgets={}, locked={}), local, taken)
        self._note_saturated(taken, more=False)
        for endpoint_id in verdict.gates_barren:
            self._barren[endpoint_id] = now + BARREN_FOR
        return self._prepare_all(claimed, now)

    def _note_saturated(self, taken: Mapping[int, int], *, more: bool) -> None:
        """Whether this round served only endpoints it left capped (see `saturated`)."""
        self._round_saturated = (
            not more and bool(taken) and all(eid in self._capped for eid in taken)
        )

    def _note_gate_opening(self, at: dt.datetime | None) -> None:
        """Keep the earliest gate opening seen by this claim's rounds."""
        if at is not None and (self._opening is None or at < self._opening):
            self._opening = at

    def _note_gates(
        self, gates: health.Gates, local: Mapping[int, int], taken: Mapping[int, int]
    ) -> None:
        """What the claim left wanting: endpoints behind a health gate or a capped tenant,
        and endpoints whose share of this worker's slots it used up (or found used up)."""
        self._gated = frozenset(gates.budgets) | frozenset(
            endpoint_id
            for endpoint_id, tenant_id in gates.tenant_of.items()
            if tenant_id in gates.tenant_budgets
        )
        cap = self.config.endpoint_slots
        self._capped = frozenset(
            endpoint_id
            for endpoint_id in {*local, *taken}
            if taken.get(endpoint_id, 0) >= local.get(endpoint_id, cap)
        )

    def _slots_left(self) -> dict[int, int]:
        """Per endpoint with attempts running here: how many more slots it may take."""
        cap = self.config.endpoint_slots
        return {endpoint_id: max(0, cap - held) for endpoint_id, held in self._slots_held.items()}

    def _key(self, stored: str, endpoint_uid: str) -> SigningKey:
        return _memo(
            self._keys,
            stored,
            lambda: signing_key(self._box.decrypt(stored, context=secret_context(endpoint_uid))),
        )

    def _policy(
        self, own: Sequence[float] | None, event_type: str, max_attempts: int
    ) -> RetryPolicy:
        """The endpoint's schedule, else the event type's, else the global one. Max attempts
        were resolved the same way when the delivery was created (the relay)."""
        return _memo(
            self._policies,
            (tuple(own) if own else None, "" if own else event_type, max_attempts),
            lambda: RetryPolicy(
                schedule=tuple(
                    own
                    or matching_rule(self.config.retry_schedule_by_event_type, event_type)
                    or self.config.retry_schedule
                ),
                max_attempts=max_attempts,
                jitter=self.config.retry_jitter,
                retry_after_max=self.config.retry_after_max,
            ),
        )

    def _prepare_all(self, rows: Sequence[Any], now: dt.datetime) -> list[ClaimedDelivery]:
        """What each claimed row needs to be sent. Within one batch (one statement's
        rows, one snapshot) what derives from the endpoint's columns is worked out once
        per endpoint, and the envelope once per event: a fan-out's rows share both."""
        endpoints: dict[int, _EndpointParts] = {}
        bodies: dict[tuple[str, dt.datetime, str], bytes] = {}
        prepared = []
        for row in rows:
            parts = endpoints.get(row.endpoint_id)
            if parts is None:
                parts = endpoints[row.endpoint_id] = self._endpoint_parts(row, now)
            event = (row.event_type, row.event_created_at, row.payload_json)
            body = bodies.get(event)
            if body is None:
                body = bodies[event] = _envelope(
                    self._type_json_of(row.event_type), row.event_created_at, row.payload_json
                )
            prepared.append(self._claimed(row, parts, body))
        return prepared

    def _type_json_of(self, event_type: str) -> str:
        return _memo(self._type_json, event_type, lambda: json.dumps(event_type))

    def _claimed(self, row: Any, parts: _EndpointParts, body: bytes) -> ClaimedDelivery:
        return ClaimedDelivery(
            id=row.id,
            claim=row.claim,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            endpoint_uid=row.endpoint_uid,
            endpoint_id=row.endpoint_id,
            endpoint_spotless=row.endpoint_spotless,
            event_type=row.event_type,
            traceparent=row.traceparent,
            hold_ambiguous=bool(row.hold_ambiguous),
            policy=self._policy(row.retry_schedule, row.event_type, row.max_attempts),
            request=OutgoingRequest(
                delivery_id=row.id,
                url=parts.url,
                message_id=row.message_id,
                body=body,
                keys=parts.keys,
                timeout=parts.timeout,
                status_overrides=parts.status_overrides,
                retry_after_max=self.config.retry_after_max,
                extra_headers=parts.extra_headers,
                proxy=parts.proxy,
                client_certificate=parts.client_certificate,
                oauth=parts.oauth,
            ),
        )

    def _endpoint_parts(self, row: Any, now: dt.datetime) -> _EndpointParts:
        """What a row's request takes from its endpoint's columns (the same for every row
        of that endpoint in one batch)."""
        keys = [self._key(row.signing_secret, row.endpoint_uid)]
        if row.previous_signing_secret and (
            row.previous_secret_expires_at is None or row.previous_secret_expires_at > now
        ):
            keys.append(self._key(row.previous_signing_secret, row.endpoint_uid))
        return _EndpointParts(
            url=row.url,
            keys=keys,
            timeout=min(
                row.timeout_seconds or self.config.request_timeout, self.config.longest_deadline
            ),
            status_overrides=(
                parse_status_overrides(row.status_overrides)
                if row.status_overrides
                else _NO_OVERRIDES
            ),
            extra_headers=self._custom_headers(row.custom_headers, row.endpoint_uid),
            proxy=self._proxy(row.proxy_url, row.endpoint_uid) if row.proxy_url else None,
            client_certificate=(
                _memo(
                    self._client_certificates,
                    row.client_certificate,
                    lambda: decrypt_client_certificate(
                        self._box, row.endpoint_uid, row.client_certificate
                    ),
                )
                if row.client_certificate
                else None
            ),
            oauth=(
                _memo(
                    self._oauth_clients,
                    row.oauth_client,
                    lambda: decrypt_oauth_client(self._box, row.endpoint_uid, row.oauth_client),
                )
                if row.oauth_client
                else None
            ),
        )

    def _custom_headers(self, stored: str | None, endpoint_uid: str) -> Mapping[str, str]:
        if not stored:
            return _NO_HEADERS
        return _memo(
            self._headers, stored, lambda: decrypt_headers(self._box, endpoint_uid, stored)
        )

    def _proxy(self, stored: str, endpoint_uid: str) -> str:
        return _memo(self._proxies, stored, lambda: decrypt_proxy(self._box, endpoint_uid, stored))


class _EndpointParts(NamedTuple):
    """A claimed row's request parts that come from its endpoint alone."""

    url: str
    keys: list[SigningKey]
    timeout: float
    status_overrides: Mapping[int, Outcome]
    extra_headers: Mapping[str, str]
    proxy: str | None
    client_certificate: ClientCertificate | None
    oauth: OAuthClient | None
