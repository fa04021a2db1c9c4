"""The worker's run loop: attempts in flight, claims as slots free, outcomes written in batches."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import functools
import logging
import random
from collections.abc import Sequence
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import AttemptResult
from delivery.policy import RetryPolicy
from delivery.worker.claiming import Claiming
from delivery.worker.model import BatchStats, ClaimedDelivery, WorkerConfig
from delivery.worker.outcomes import Recording
from outbox import direct
from outbox.clock import Clock
from outbox.crypto import SecretBox, SigningKey
from outbox.endpoint_auth import ClientCertificate, OAuthClient
from outbox.notify import wait_for_any
from outbox.outage import OUTAGE
from outbox.relay import Capacity

# The worker's one logger, named as before it became a package.
log = logging.getLogger("delivery.worker")


class Worker(Claiming, Recording):
    def __init__(
        self,
        engine: AsyncEngine,
        http: httpx.AsyncClient,
        box: SecretBox,
        clock: Clock,
        config: WorkerConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._engine = engine
        self._http = http
        self._box = box
        self._clock = clock
        self.config = config or WorkerConfig()
        self._rng = rng or random.Random()
        self._keys: dict[str, SigningKey] = {}
        self._headers: dict[str, dict[str, str]] = {}
        self._proxies: dict[str, str] = {}
        self._client_certificates: dict[str, ClientCertificate] = {}
        self._oauth_clients: dict[str, OAuthClient] = {}
        # What _prepare_all derives the same way for every delivery of an endpoint or event
        # type, built once (the drain profile had it at a seventh of worker CPU).
        self._policies: dict[tuple[tuple[float, ...] | None, str, int], RetryPolicy] = {}
        self._type_json: dict[str, str] = {}
        self._pending: list[tuple[ClaimedDelivery, AttemptResult]] = []
        # While `run` runs: the connection its outcome writer keeps between writes that
        # follow each other closely (see _write_outcomes).
        self._outcomes_held: direct.HeldConnection | None = None
        self._results_ready = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._started: set[int] = set()  # deliveries whose request left the pool
        self.stats = BatchStats()
        self._slots_held: collections.Counter[int] = collections.Counter()
        self._health_rows: set[int] = set()
        # What the last claim left wanting (see `run`): endpoints it could take no more of
        # (this worker's share used up, or a health gate), whether every slot was busy, and
        # the earliest moment a health gate opens by itself.
        self._gated: frozenset[int] = frozenset()
        self._capped: frozenset[int] = frozenset()
        self._waiting: frozenset[int] = frozenset()
        self._full = False
        self._finished_while_claiming: list[int] | None = None  # endpoint ids, during a claim
        self._freed = 0
        self._refilled = asyncio.Event()
        self.next_gate_at: dt.datetime | None = None
        self._opening: dt.datetime | None = None  # during a claim (see `claim`)
        self.claims = 0  # claim statements run (the tests count them)
        # Endpoints a recent claim visited without finding anything claimable, set aside
        # until then (health.choose_endpoints puts them last).
        self._barren: dict[int, dt.datetime] = {}
        # Tenants with due work at the last claim, about: with a batch's worth or more, the
        # next claim tries to find its batch from the oldest due rows alone
        # (queries.QUICK_CLAIM_GATES); with fewer, that cannot work.
        self._spread = 1_000_000
        # How each claim round found its endpoints: "quick" or "all" (tests, bench).
        self.gate_paths: collections.Counter[str] = collections.Counter()
        # While `run` runs: its attempts, and whether fresh deliveries may come straight
        # from the relay of this process (see `reserve`).
        self._in_flight: dict[asyncio.Task[None], ClaimedDelivery] = {}
        self._accepting = False
        self._caught_up = False
        self._wake: asyncio.Event | None = None
        self._reserved = 0
        self._claiming = False
        self._claim_waiters: list[asyncio.Future[None]] = []
        self.handed_off = 0  # deliveries taken from the relay without a claim (tests)
        self._stop_now = asyncio.Event()  # see `stop_now`

    # -- the run loop -----------------------------------------------------------------

    async def run_once(self) -> BatchStats:
        """Claim one batch, attempt every delivery in it concurrently, record the outcomes."""
        claimed = await self.claim(min(self.config.batch_size, self.config.max_in_flight))
        results = await asyncio.gather(*(self.attempt(item) for item in claimed))
        return await self.record(list(zip(claimed, results, strict=True)))

    # -- the long-running loop ------------------------------------------------------

    async def run(self, stop: asyncio.Event, wakeup: asyncio.Event | None = None) -> None:
        """Keep up to max_in_flight attempts running until `stop`; then drain and exit.

        The next claim happens when there is reason to expect work it can take:
        the last claim came back full (claim again at once), a NOTIFY says new
        deliveries are due, a completion freed a slot the last claim wanted (the
        worker was full, or the delivery's endpoint had used up its share of slots or
        its health gate), or a health gate opens by itself (a pause or cooldown
        ends, a token refills). Completions are batched: the claim waits up to
        `claim_gather` for `refill` of them. The poll interval is only the safety net
        (other processes' completions, a missed notification).
        """
        wake = wakeup or asyncio.Event()
        in_flight: dict[asyncio.Task[None], ClaimedDelivery] = {}
        self._in_flight, self._wake, self._accepting = in_flight, wake, True
        closing = asyncio.Event()
        writer = asyncio.create_task(self._write_outcomes(closing), name="outcome-writer")
        try:
            while not stop.is_set():
                free = self.config.max_in_flight - len(in_flight) - self._reserved
                if free > 0:
                    wake.clear()
                    self._slot_free.clear()
                    self._refilled.clear()
                    self._freed = 0
                    want = min(self.config.batch_size, free)
                    self._finished_while_claiming = []
                    self._caught_up = False
                    self._claiming = True
                    try:
                        claimed = await self.claim(want)
                        OUTAGE.succeeded()
                        # Nothing more was due that this worker could take: fresh
                        # deliveries may come straight from the relay until a claim
                        # is due again.
                        self._caught_up = len(claimed) < want or self.saturated
                    except Exception as exc:
                        OUTAGE.failed("worker claim", exc)
                        claimed = []
                    finally:
                        meanwhile, self._finished_while_claiming = (
                            self._finished_while_claiming,
                            None,
                        )
                        self._claiming = False
                        self._claim_settled()
                    self._start(claimed)
                    self._waiting = self._gated | self._capped
                    # Slots freed while the claim ran, of endpoints it has just found wanting.
                    for endpoint_id in meanwhile:
                        if endpoint_id in self._waiting:
                            self._note_freed()
                    if len(claimed) == want and not (self._full or self.saturated):
                        continue  # a full batch: more may be due
                await wait_for_any(stop, wake, self._slot_free, timeout=self._idle_timeout())
                if self._slot_free.is_set() and not (wake.is_set() or stop.is_set()):
                    await wait_for_any(stop, wake, self._refilled, timeout=self.config.claim_gather)
        finally:
            self._accepting = False
            await self._drain(in_flight)
            # Never cancel the writer mid-write: tell it to finish what is buffered.
            closing.set()
            self._results_ready.set()
            await writer

    @property
    def in_flight(self) -> int:
        """Attempts `run` has going (the shutdown message counts them)."""
        return len(self._in_flight)

    def drain_deadline(self) -> float:
        """How long stopping waits at most for the attempts in flight: their longest
        deadline, cut to the shutdown grace."""
        longest = max((item.request.timeout for item in self._in_flight.values()), default=0.0)
        return min(self.config.shutdown_grace, longest)

    def stop_now(self) -> None:
        """Stop waiting for attempts in flight (a second Ctrl-C): cancel them and hand
        their claims back, so they are due again at once instead of after lease expiry."""
        self._stop_now.set()

    def _start(self, claimed: Sequence[ClaimedDelivery]) -> None:
        """Start the attempts of claimed deliveries (in `run`), each holding a slot."""
        in_flight = self._in_flight
        finished = functools.partial(self._finished, in_flight)  # one for the whole batch
        for item in claimed:
            task = asyncio.create_task(self._attempt_and_buffer(item))
            in_flight[task] = item
            self._slots_held[item.endpoint_id] += 1
            task.add_done_callback(finished)
        self._full = len(in_flight) >= self.config.max_in_flight

    # -- taking fresh deliveries from the relay (outbox.relay.Handoff) ----------------

    @property
    def taking_from_relay(self) -> bool:
        """`run` runs and its last claim found nothing more due (see `reserve`)."""
        return self._accepting and self._caught_up

    async def settle(self) -> None:
        """Before the relay reserves: let a claim that runs, or that a pending wake-up is
        about to start, finish first (at most `relay_settle`).

        Its verdict then decides the handoff. Otherwise a relay pass that overlaps a claim
        schedules its deliveries and notifies, which starts another claim, which the next
        pass overlaps: at a steady trickle most deliveries would take a claim transaction.
        """
        if not (self.config.take_from_relay and self._accepting):
            return
        pending = self._wake is not None and self._wake.is_set()
        free = self.config.max_in_flight - len(self._in_flight) - self._reserved
        if not (self._claiming or (pending and free > 0)):
            return
        settled = asyncio.get_running_loop().create_future()
        self._claim_waiters.append(settled)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled, self.config.relay_settle)

    def _claim_settled(self) -> None:
        waiters, self._claim_waiters = self._claim_waiters, []
        for settled in waiters:
            if not settled.done():
                settled.set_result(None)

    def reserve(self) -> Capacity | None:
        """Free slots the relay of this process may fill with deliveries it inserts
        already claimed for this worker, or None.

        Only while `run` runs and its last claim found nothing more due (so nothing
        that waits longer is overtaken: fairness and priorities stay the claim's) and no
        wake-up is pending. The slots stay reserved until `take`.
        """
        if not (self.config.take_from_relay and self.taking_from_relay):
            return None
        if self._wake is not None and self._wake.is_set():
            return None
        free = self.config.max_in_flight - len(self._in_flight) - self._reserved
        limit = min(self.config.batch_size, free)
        if limit <= 0:
            return None
        self._reserved += limit
        now = self._clock.now()
        return Capacity(
            limit=limit,
            worker_id=self.config.worker_id,
            lease_expires_at=now + dt.timedelta(seconds=self.config.lease_seconds),
            endpoint_slots=self.config.endpoint_slots,
            slots_left=self._slots_left(),
        )

    async def take(self, capacity: Capacity, rows: Sequence[Any], now: dt.datetime) -> None:
        """Attempt the deliveries the relay handed off (claimed for this worker, claim
        number and lease included), freeing the reservation `capacity`. After `run`
        stopped they are handed back at once, like unstarted claims at shutdown."""
        self._reserved = max(0, self._reserved - capacity.limit)
        if not rows:
            return
        claimed = self._prepare_all(rows, now)
        self.handed_off += len(claimed)
        if not self._accepting:
            await self._release_at_shutdown(claimed)
            return
        self._start(claimed)

    def _idle_timeout(self) -> float:
        """The poll interval, or less when a health gate opens sooner."""
        timeout = self.config.poll_interval
        if self.next_gate_at is not None:
            until_open = (self.next_gate_at - self._clock.now()).total_seconds()
            timeout = min(timeout, max(until_open, self.config.claim_gather))
        return timeout

    def _finished(
        self, in_flight: dict[asyncio.Task[None], ClaimedDelivery], task: asyncio.Task[None]
    ) -> None:
        item = in_flight.pop(task, None)
        if item is None:
            return
        self._slots_held[item.endpoint_id] -= 1
        if self._slots_held[item.endpoint_id] <= 0:
            del self._slots_held[item.endpoint_id]
        if self._finished_while_claiming is not None:
            self._finished_while_claiming.append(item.endpoint_id)
        if self._full or item.endpoint_id in self._waiting:
            # A slot the last claim could not fill is free: that claim left work behind.
            self._note_freed()

    def _note_freed(self) -> None:
        self._freed += 1
        self._slot_free.set()
        if self._freed >= self.config.refill:
            self._refilled.set()

    async def _attempt_and_buffer(self, claimed: ClaimedDelivery) -> None:
        try:
            result = await self.attempt(claimed)
        except Exception:
            # A bug, not a delivery outcome (those are values). The claim is left to lease
            # expiry and the reaper, whose rescue count stops a delivery that keeps doing this.
            log.exception(
                "attempt of delivery %d failed unexpectedly; left to the reaper", claimed.id
            )
            return
        finally:
            self._started.discard(claimed.id)
        self._pending.append((claimed, result))
        self._results_ready.set()

    async def _write_outcomes(self, closing: asyncio.Event) -> None:
        """Write outcomes as they arrive (batching whatever piled up meanwhile) until closing.

        Writes that follow each other within `outcome_linger` (a steady trickle: one
        event's outcomes every few ms) share one pooled connection: no checkout and
        pre-ping round trip per write. It goes back to the pool once none came that long.
        """
        held = self._outcomes_held = direct.HeldConnection(self._engine)
        try:
            while True:
                if held.held and not self._results_ready.is_set():
                    await wait_for_any(self._results_ready, timeout=self.config.outcome_linger)
                    if not self._results_ready.is_set():
                        await held.release()
                await self._results_ready.wait()
                await asyncio.sleep(self.config.flush_gather)  # let a batch build up
                self._results_ready.clear()
                await self._flush_all()
                if closing.is_set() and not self._pending:
                    return
        finally:
            self._outcomes_held = None
            await held.release()

    async def _flush_all(self) -> None:
        """Write every buffered outcome; on a database error keep them and try again."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                self.stats.merge(await self.record(batch))
                OUTAGE.succeeded()
                self._recorded(batch)
            except asyncio.CancelledError:
                self._pending[:0] = batch
                raise
            except Exception as exc:
                OUTAGE.failed(f"recording {len(batch)} outcomes", exc)
                self._pending[:0] = batch
                await asyncio.sleep(self.config.poll_interval)

    def _recorded(self, batch: Sequence[tuple[ClaimedDelivery, AttemptResult]]) -> None:
        """Outcomes written: their slots are free in the database's count now too. An
        in-flight limit or tenant cap counts the rows in flight there, and a claim woken by
        the completions themselves may have run before this write and found the limit
        used up: wake it again, or the endpoint waits for the poll."""
        waiting = self._waiting
        if waiting and any(item.endpoint_id in waiting for item, _ in batch):
            self._slot_free.set()
            self._refilled.set()

    async def _drain(self, in_flight: dict[asyncio.Task[None], ClaimedDelivery]) -> None:
        """Hand back queued claims at once, let running attempts finish, release the rest.

        A claim whose request has not left the connection pool yet sent nothing, so it
        is cancelled and released immediately (no attempt spent, due again at once)
        instead of waiting for the shutdown grace or its lease to run out. Running
        attempts are bounded by their deadline, or cut short by `stop_now`.
        """
        if not in_flight:
            return
        queued = {task: item for task, item in in_flight.items() if item.id not in self._started}
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        handed_back = [item for task, item in queued.items() if task.cancelled()]
        if handed_back:
            released = await self._release_at_shutdown(handed_back)
            log.info("shutdown: released %d claimed deliveries that had not started", released)
        if not in_flight:
            return
        await self._wait_unless_stopped_now(in_flight)
        unfinished = [task for task in in_flight if not task.done()]
        leftovers = [in_flight[task] for task in unfinished]
        for task in unfinished:
            task.cancel()
        if leftovers:
            released = await self._release_at_shutdown(leftovers)
            log.info("shutdown: released %d unfinished deliveries", released)

    async def _wait_unless_stopped_now(
        self, in_flight: dict[asyncio.Task[None], ClaimedDelivery]
    ) -> None:
        """Wait for the attempts in flight, at most the shutdown grace, or until `stop_now`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace
        hurry = asyncio.create_task(self._stop_now.wait())
        try:
            while not hurry.done():
                running = [task for task in in_flight if not task.done()]
                remaining = deadline - loop.time()
                if not running or remaining <= 0:
                    return
                await asyncio.wait(
                    [*running, hurry], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            hurry.cancel()

    async def _release_at_shutdown(self, claims: Sequence[ClaimedDelivery]) -> int:
        """Hand claims back; with the database away, leave them to the reaper (lease expiry)."""
        try:
            return await self.release(claims)
        except Exception as exc:
            OUTAGE.failed(
                f"releasing {len(claims)} claims at shutdown (the reaper takes them)", exc
            )
            return 0
