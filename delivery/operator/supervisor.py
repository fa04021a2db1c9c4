"""`outbox run --processes N`: N independent service processes on one host.

Why processes: one Python process delivers on one core (the GIL), and a worker's
time goes to HTTP parsing, signing and SQL round trips, not to waiting. Each child
runs the whole `Service` (relay, worker, reaper) exactly as a single-process run
does, with its own worker id, engine and HTTP pool. The children share nothing but
the database: claims use SKIP LOCKED and leases, so they coordinate there, and the
same holds for processes on other hosts pointed at the same PostgreSQL.

The parent only starts children, forwards SIGINT/SIGTERM, and restarts a child that
died unexpectedly (its in-flight deliveries come back through the reaper when their
lease expires).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Protocol

from delivery.operator.loop import run_loop, settle_heap
from delivery.reaper import ReaperConfig
from delivery.retention import RetentionConfig
from delivery.worker import WorkerConfig
from outbox.crypto import SecretBox
from outbox.logging_setup import configure_logging
from outbox.relay import RelayConfig

log = logging.getLogger(__name__)

RESTART_DELAY = 1.0
_NO_RETENTION = RetentionConfig(retention_days=0, dead_retention_days=0)  # 0 = keep for ever


def default_processes() -> int:
    """The cores this process may run on (its CPU affinity), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """Everything a child needs, picklable: the children are spawned, not forked."""

    url: str
    secret_keys: str
    relay: RelayConfig
    worker: WorkerConfig
    reaper: ReaperConfig
    retention: RetentionConfig | None = None
    allowed_networks: tuple[str, ...] = ()
    https_only: bool = False
    http_transport: str = "wire"
    http_proxy: str | None = dataclasses.field(default=None, repr=False)  # may hold a password
    log_level: str = "WARNING"
    log_format: str = "text"
    summary_interval: float = 0.0
    event_loop: str = "auto"


def child_spec(spec: ProcessSpec, index: int) -> ProcessSpec:
    """Each child gets its own worker id, so leases and attempt rows say who did what."""
    return dataclasses.replace(
        spec,
        worker=dataclasses.replace(spec.worker, worker_id=f"{spec.worker.worker_id}.{index}"),
        # One pruner is enough; the others would only compete for the same rows.
        retention=spec.retention
        if index == 0
        else RetentionConfig(retention_days=0, dead_retention_days=0),
    )


_PR_SET_PDEATHSIG = 1


def _stop_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM this child when the supervisor dies, even by SIGKILL.

    Otherwise a killed supervisor leaves its children delivering with nobody to stop
    them. SIGTERM is the ordinary graceful stop: attempts in flight finish, the rest
    is handed back. Elsewhere (no prctl) nothing changes.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _child_main(spec: ProcessSpec, parent_pid: int | None = None) -> None:
    from delivery.operator.app import Service

    # The supervisor alone answers a terminal's Ctrl-C, which reaches the whole process
    # group: it tells each child SIGTERM (finish what is in flight), then SIGUSR1 (now).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while it started
    if parent_pid is not None:
        _stop_with_parent(parent_pid)

    configure_logging(spec.log_level, fmt=spec.log_format)  # redacting, quiet about httpx
    service = Service(
        spec.url,
        SecretBox.from_setting(spec.secret_keys),
        relay=spec.relay,
        worker=spec.worker,
        reaper=spec.reaper,
        retention=spec.retention,
        allowed_networks=spec.allowed_networks,
        https_only=spec.https_only,
        http_transport=spec.http_transport,
        http_proxy=spec.http_proxy,
        summary_interval=spec.summary_interval,
    )
    settle_heap()
    run_loop(run_until_signalled(service, supervised=True), spec.event_loop)


class Stoppable(Protocol):
    """What `run_until_signalled` stops: `app.Service`."""

    @property
    def in_flight(self) -> int: ...

    def drain_deadline(self) -> float: ...

    def stop_now(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...


async def run_until_signalled(
    service: Stoppable,
    also: Sequence[Callable[[asyncio.Event], Coroutine[Any, Any, None]]] = (),
    *,
    supervised: bool = False,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run `service.run(stop)` (and each of `also` with the same `stop`) until a signal.

    SIGINT or SIGTERM stops claiming and lets the attempts in flight finish, saying how
    many and for how long at most; Ctrl-C again (a SIGINT after that) stops at once,
    handing their claims back. A supervised child leaves SIGINT to its supervisor (a
    terminal's Ctrl-C reaches the whole process group) and takes SIGUSR1 as "at once".
    `on_ready` runs once these signals are handled (say "running" there, not before).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def graceful() -> None:
        if stop.is_set():
            return
        stop.set()
        count = service.in_flight
        if count:
            attempts = "1 attempt" if count == 1 else f"{count} attempts"
            deadline = math.ceil(service.drain_deadline())
            print(
                f"waiting for {attempts} in flight (deadline {deadline}s); "
                "Ctrl-C again to stop now",
                file=sys.stderr,
                flush=True,
            )

    def interrupted() -> None:
        if stop.is_set():
            at_once()
        else:
            graceful()

    def at_once() -> None:
        stop.set()
        count = service.in_flight
        if count:
            print(
                f"stopping now: handing back {count} unfinished "
                f"{'delivery' if count == 1 else 'deliveries'}",
                file=sys.stderr,
                flush=True,
            )
        service.stop_now()

    handlers: dict[signal.Signals, Callable[[], None]] = {signal.SIGTERM: graceful}
    if supervised:
        handlers[signal.SIGUSR1] = at_once  # SIGINT stays ignored (see _child_main)
    else:
        handlers[signal.SIGINT] = interrupted
    for signum, handler in handlers.items():
        loop.add_signal_handler(signum, handler)
    try:
        if on_ready is not None:
            on_ready()
        async with asyncio.TaskGroup() as group:
            group.create_task(service.run(stop))
            for runner in also:
                group.create_task(runner(stop))
    finally:
        for signum in handlers:
            loop.remove_signal_handler(signum)


class Supervisor:
    """Keeps `processes` children running until told to stop."""

    def __init__(self, spec: ProcessSpec, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.spec = spec
        self.processes = processes
        self._context = multiprocessing.get_context("spawn")
        self._children: dict[int, BaseProcess] = {}
        self._stopping = False

    def _start(self, index: int) -> None:
        child = self._context.Process(
            target=_child_main,
            args=(child_spec(self.spec, index), os.getpid()),
            name=f"outbox-{index}",
            daemon=False,
        )
        # A child starts with SIGINT ignored (the disposition survives exec): a Ctrl-C while
        # it is still importing must not kill it with a traceback. Blocked meanwhile, the
        # supervisor's own Ctrl-C waits until the child is started instead of being lost.
        if threading.current_thread() is not threading.main_thread():
            child.start()  # only the main thread may change signal handlers
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                child.start()
            finally:
                signal.signal(signal.SIGINT, previous)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self._children[index] = child

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Ask every child to finish its in-flight attempts and exit (idempotent)."""
        self._stopping = True
        self._signal_children(signal.SIGTERM)

    def stop_now(self) -> None:
        """Ask every child to stop at once, handing its unfinished claims back."""
        self._stopping = True
        self._signal_children(signal.SIGUSR1)

    def _signal_children(self, signum: signal.Signals) -> None:
        for child in list(self._children.values()):
            if child.is_alive() and child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    def run(self, grace: float) -> int:
        """Start the children, supervise until stop(), then wait up to `grace` s for them."""
        for index in range(self.processes):
            if self._stopping:
                break
            self._start(index)
        while not self._stopping:
            sentinels = {child.sentinel: index for index, child in self._children.items()}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            for sentinel in ready:
                index = next(i for s, i in sentinels.items() if s == sentinel)
                child = self._children[index]
                child.join()
                if self._stopping:
                    break
                log.error(
                    "worker process %s exited with %s; restarting it in %.0fs",
                    child.name,
                    child.exitcode,
                    RESTART_DELAY,
                )
                time.sleep(RESTART_DELAY)
                if not self._stopping:
                    self._start(index)
        # A child started while the stop signal was being handled did not get it.
        self.stop()
        deadline = time.monotonic() + grace
        failed = 0
        for child in self._children.values():
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                log.error("worker process %s did not stop in %.0fs; killing it", child.name, grace)
                child.kill()
                child.join()
            # Killed by a stop signal before it could handle one: it had nothing claimed.
            if child.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGUSR1):
                failed += 1
        return 1 if failed else 0


def run_supervised(
    spec: ProcessSpec, processes: int, grace: float, on_ready: Callable[[], None] | None = None
) -> int:
    """Run the supervisor in the foreground until SIGINT/SIGTERM; returns an exit status.

    `on_ready` runs once those signals are handled."""
    supervisor = Supervisor(spec, processes)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and supervisor.stopping:
            supervisor.stop_now()  # Ctrl-C again
        else:
            supervisor.stop()

    previous = {
        signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if on_ready is not None:
            on_ready()
        return supervisor.run(grace)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
