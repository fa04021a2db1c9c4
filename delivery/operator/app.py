"""Wiring: settings in, running services out. Only the CLI (and the demo) call this."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.health import HealthConfig
from delivery.health.adaptive import AdaptiveConfig
from delivery.http import DEFAULT_TRANSPORT, build_http_client
from delivery.reaper import Reaper, ReaperConfig
from delivery.retention import Retention, RetentionConfig
from delivery.summary import Summary
from delivery.worker import Worker, WorkerConfig
from outbox import migrate
from outbox.clock import Clock, SystemClock
from outbox.crypto import SecretBox, load_or_create_local_key
from outbox.db import check_reachable, make_async_engine, make_engine
from outbox.embedded import EmbeddedPostgres
from outbox.endpoints import check_keys_cover_stored_secrets
from outbox.errors import ConfigurationError
from outbox.notify import Listener
from outbox.relay import Relay, RelayConfig
from outbox.schema_rules import SchemaLimits
from outbox.settings import Settings
from outbox.sql.relay import DELIVERIES_CHANNEL, EVENTS_CHANNEL
from outbox.stats import AlertThresholds

if TYPE_CHECKING:
    from delivery.operator.context import AdminConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Database:
    url: str
    engine: Engine
    embedded: bool


@contextlib.contextmanager
def open_database(
    settings: Settings, *, auto_migrate: bool | None = None, check_schema: bool = True
) -> Iterator[Database]:
    """Connect to OUTBOX_DATABASE_URL, or start the embedded server; migrate or check schema.

    The embedded database is private, so it is migrated automatically. A database
    the user runs is only checked: `outbox migrate` changes it, nothing else does.
    A schema a newer release migrated is accepted (a release runs on the next one's
    schema: docs/operating.md, Upgrading); one with this release's migrations pending is not.
    """
    with contextlib.ExitStack() as stack:
        if settings.database_url:
            url, embedded = settings.database_url, False
        else:
            server = stack.enter_context(EmbeddedPostgres(settings.data_dir))
            url, embedded = server.url(), True
        engine = make_engine(url)
        stack.callback(engine.dispose)
        check_reachable(engine)
        if auto_migrate if auto_migrate is not None else embedded:
            migrate.upgrade(engine)
        elif check_schema:
            state = migrate.schema_state(migrate.current_revision(engine))
            if not state.usable:
                raise ConfigurationError(
                    f"the database schema is at {state.current or 'nothing'}, this version "
                    f"({migrate.release_version()}) needs {state.needed}: run `outbox migrate`"
                    " first (`outbox migrate --sql` shows what it will run)"
                )
            if state.state == "newer":
                log.info(
                    "the database schema is at %s, newer than this version's %s: a later "
                    "release migrated it; running on it as the upgrade contract allows",
                    state.current,
                    state.needed,
                )
        yield Database(url=url, engine=engine, embedded=embedded)


def secret_box(settings: Settings, database: Database) -> SecretBox:
    """The keys for endpoint secrets; refuses to start if a stored secret would not decrypt."""
    box = SecretBox.from_setting(secret_keys_setting(settings, database))
    with database.engine.connect() as conn:
        check_keys_cover_stored_secrets(conn, box)
    return box


def http_proxy_setting(settings: Settings) -> str | None:
    """OUTBOX_HTTP_PROXY in plain text, for the HTTP client only (it may hold a password)."""
    return None if settings.http_proxy is None else settings.http_proxy.get_secret_value()


def secret_keys_setting(settings: Settings, database: Database) -> str:
    """The OUTBOX_SECRET_KEYS value in force (worker processes are handed this string)."""
    if settings.secret_keys:
        return settings.secret_keys
    if database.embedded:
        return load_or_create_local_key(settings.data_dir)
    raise ConfigurationError(
        "OUTBOX_SECRET_KEYS is not set: endpoint secrets are encrypted at rest and need a key. "
        "Generate one with `outbox keys generate` and keep it in your secret store."
    )


def relay_config(settings: Settings) -> RelayConfig:
    return RelayConfig(
        batch_size=settings.relay_batch_size,
        poll_interval=settings.relay_poll_interval,
        default_max_attempts=settings.max_attempts,
        max_attempts_by_event_type={
            pattern: rule.max_attempts
            for pattern, rule in settings.event_type_retry.items()
            if rule.max_attempts is not None
        },
        event_types_mode=settings.event_types,
        validation_budget=settings.validation_budget_ms / 1000,
    )


def schema_limits(settings: Settings) -> SchemaLimits:
    """The caps `event-types add/update` (CLI and admin API) check a schema against."""
    return SchemaLimits(
        max_bytes=settings.max_schema_bytes,
        max_depth=settings.max_schema_depth,
        max_keywords=settings.max_schema_keywords,
    )


def worker_config(settings: Settings) -> WorkerConfig:
    return WorkerConfig(
        batch_size=settings.worker_batch_size,
        max_in_flight=settings.worker_max_in_flight,
        poll_interval=settings.worker_poll_interval,
        lease_seconds=settings.lease_seconds,
        request_timeout=settings.request_timeout,
        retry_schedule=tuple(settings.retry_schedule),
        retry_jitter=settings.retry_jitter,
        retry_after_max=settings.retry_after_max,
        retry_schedule_by_event_type={
            pattern: tuple(rule.schedule)
            for pattern, rule in settings.event_type_retry.items()
            if rule.schedule is not None
        },
        health=health_config(settings),
        endpoint_share=settings.worker_endpoint_share,
    )


def health_config(settings: Settings) -> HealthConfig:
    return HealthConfig(
        failure_threshold=settings.breaker_failure_threshold,
        failure_ratio=settings.breaker_failure_ratio,
        ratio_window_seconds=settings.breaker_window_seconds,
        ratio_min_attempts=settings.breaker_min_attempts,
        cooldown_seconds=settings.breaker_cooldown_seconds,
        cooldown_max_seconds=settings.breaker_cooldown_max_seconds,
        ramp_seconds=settings.ramp_seconds,
        ramp_start_per_second=settings.ramp_start_per_second,
        ramp_step_per_second=settings.ramp_step_per_second,
        throttle_seconds=settings.throttle_seconds,
        auto_disable_after_seconds=settings.auto_disable_after_days * 86400.0,
        # A probe whose worker died may be retried once its lease could have expired.
        probe_lease_seconds=settings.lease_seconds,
        adaptive=AdaptiveConfig(
            algorithm=settings.adaptive_algorithm, default_maximum=settings.adaptive_default_max
        ),
    )


def retention_config(settings: Settings) -> RetentionConfig:
    return RetentionConfig(
        retention_days=settings.retention_days,
        dead_retention_days=settings.dead_retention_days,
        audit_retention_days=settings.audit_retention_days,
        batch_size=settings.retention_batch_size,
        interval=settings.retention_interval,
    )


def alert_thresholds(settings: Settings) -> AlertThresholds:
    return AlertThresholds(
        dead_per_window=settings.alert_dead_per_window,
        repeated_error_deliveries=settings.alert_repeated_error_deliveries,
        oldest_due_seconds=settings.alert_oldest_due_seconds,
        relay_lag_seconds=settings.alert_relay_lag_seconds,
    )


def admin_config(settings: Settings) -> AdminConfig:
    # Imported here: the operator context brings starlette, which only serving needs.
    from delivery.operator.console.config import ConsoleConfig
    from delivery.operator.context import AdminConfig

    return AdminConfig(
        stats_window=dt.timedelta(seconds=settings.stats_window_seconds),
        thresholds=alert_thresholds(settings),
        replay_rate_per_minute=settings.replay_rate_per_minute,
        metrics_public=settings.admin_metrics_public,
        https_only=settings.https_only,
        allowed_networks=tuple(settings.allowed_networks),
        max_body_bytes=settings.admin_max_body_bytes,
        refused_interval=dt.timedelta(seconds=settings.admin_refused_interval_seconds),
        unauthenticated_per_minute=settings.admin_unauthenticated_per_minute,
        trusted_proxies=tuple(settings.trusted_proxies),
        schema_limits=schema_limits(settings),
        validation_budget=settings.validation_budget_ms / 1000,
        adaptive_default_max=settings.adaptive_default_max,
        console=ConsoleConfig(
            app_name=settings.console_app_name,
            brand_color=settings.console_brand_color,
            portal_brand=settings.portal_brand,
            frame_origins=tuple(settings.portal_frame_origins),
            public_url=settings.public_url,
        ),
    )


def reaper_config(settings: Settings) -> ReaperConfig:
    return ReaperConfig(max_rescues=settings.max_rescues)


class Service:
    """Relay, worker and reaper in one process, woken by LISTEN/NOTIFY, polling as fallback.

    Retention runs beside them, pruning old history in small batches.
    """

    def __init__(
        self,
        url: str,
        box: SecretBox,
        *,
        relay: RelayConfig,
        worker: WorkerConfig,
        reaper: ReaperConfig | None = None,
        retention: RetentionConfig | None = None,
        clock: Clock | None = None,
        http: httpx.AsyncClient | None = None,
        allowed_networks: tuple[str, ...] = (),
        https_only: bool = False,
        http_transport: str = DEFAULT_TRANSPORT,
        http_proxy: str | None = None,
        summary_interval: float = 0.0,
    ) -> None:
        self.url = url
        self._summary_interval = summary_interval
        self._box = box
        self._relay_config = relay
        self._worker_config = worker
        self._reaper_config = reaper or ReaperConfig()
        self._retention_config = retention or RetentionConfig()
        self._clock = clock or SystemClock()
        self._http = http
        self._allowed_networks = allowed_networks
        self._https_only = https_only
        self._http_transport = http_transport
        self._http_proxy = http_proxy
        self.engine: AsyncEngine | None = None
        self.listener: Listener | None = None
        self.worker: Worker | None = None

    @property
    def in_flight(self) -> int:
        """Attempts the worker has going right now."""
        return 0 if self.worker is None else self.worker.in_flight

    def drain_deadline(self) -> float:
        """How long stopping waits at most for the attempts in flight (seconds)."""
        return 0.0 if self.worker is None else self.worker.drain_deadline()

    def stop_now(self) -> None:
        """After `stop`: stop waiting for attempts in flight and hand their claims back."""
        if self.worker is not None:
            self.worker.stop_now()

    async def run(self, stop: asyncio.Event) -> None:
        engine = make_async_engine(self.url, pool_size=5, max_overflow=5)
        self.engine = engine
        owns_http = self._http is None
        http = self._http or build_http_client(
            max_connections=self._worker_config.max_in_flight,
            timeout=self._worker_config.request_timeout,
            allowed_networks=self._allowed_networks,
            https_only=self._https_only,
            transport=self._http_transport,
            proxy=self._http_proxy,
        )
        listener = Listener(self.url, [EVENTS_CHANNEL, DELIVERIES_CHANNEL])
        self.listener = listener
        await listener.start()
        deliveries_due = listener.events[DELIVERIES_CHANNEL]
        self.worker = Worker(engine, http, self._box, self._clock, self._worker_config)
        # The relay hands fresh deliveries straight to this process's worker when it can
        # take them at once (outbox.relay.Handoff); the rest are scheduled and notified.
        relay = Relay(
            engine,
            self._clock,
            self._relay_config,
            on_deliveries=deliveries_due.set,
            handoff=self.worker,
        )
        reaper = Reaper(engine, self._clock, self._reaper_config)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(relay.run(stop, listener.events[EVENTS_CHANNEL]))
                group.create_task(self.worker.run(stop, deliveries_due))
                group.create_task(reaper.run(stop))
                group.create_task(Retention(engine, self._clock, self._retention_config).run(stop))
                worker = self.worker
                summary = Summary(
                    engine,
                    self._clock,
                    lambda: worker.stats,
                    interval=self._summary_interval,
                    worker=self._worker_config.worker_id,
                )
                group.create_task(summary.run(stop))
        finally:
            await listener.close()
            if owns_http:
                await http.aclose()
            await engine.dispose()
