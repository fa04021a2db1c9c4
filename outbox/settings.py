"""Settings, validated once at the edge.

Every field is read from an `OUTBOX_`-prefixed environment variable, or from the
optional file named by `OUTBOX_ENV_FILE` (see config/outbox.example.env). Services
never see this class: the CLI turns it into the plain config objects they take.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from outbox.errors import ConfigurationError, EndpointError, InvalidEndpointURLError
from outbox.urls import parse_proxy_url

DEFAULT_RETRY_SCHEDULE = (5.0, 60.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0)
# The longest single pause a schedule may ask for; beyond it a typo (an extra zero)
# would silently park deliveries for months.
MAX_RETRY_DELAY_SECONDS = 30 * 86400.0
# A lease must outlast the attempt deadline by at least this much, so the outcome
# can be written before the reaper could consider the worker dead.
LEASE_MARGIN_SECONDS = 5.0
# The largest OUTBOX_ADAPTIVE_DEFAULT_MAX: the largest max_in_flight an endpoint may have
# (delivery.health.MAX_IN_FLIGHT; outbox/ cannot import delivery/).
MAX_ADAPTIVE_DEFAULT_MAX = 100_000
_COLOR = re.compile(r"^#[0-9a-fA-F]{6}$")
_ORIGIN = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$")
_PUBLIC_URL = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$")


def default_data_dir() -> Path:
    """Where the embedded PostgreSQL and the generated demo key live unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "webhook-outbox"


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def check_retry_schedule(value: list[float]) -> list[float]:
    """The rules every retry schedule obeys, global or per event type."""
    if not value:
        raise ValueError("must list at least one delay in seconds, e.g. '5,60,300'")
    if any(not math.isfinite(delay) for delay in value):
        raise ValueError("delays must be finite numbers of seconds")
    if any(delay < 0 for delay in value):
        raise ValueError("delays must be zero or positive seconds")
    if any(delay > MAX_RETRY_DELAY_SECONDS for delay in value):
        raise ValueError(
            f"a delay longer than {MAX_RETRY_DELAY_SECONDS:g}s (30 days) is almost certainly "
            "a typo; use fewer zeros"
        )
    return value


class EventTypeRetry(BaseModel):
    """A retry policy for the event types matching one pattern (see OUTBOX_EVENT_TYPE_RETRY)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: list[float] | None = None
    max_attempts: int | None = Field(default=None, gt=0, le=100)

    @field_validator("schedule", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("schedule")
    @classmethod
    def _schedule_sane(cls, value: list[float] | None) -> list[float] | None:
        return None if value is None else check_retry_schedule(value)

    @model_validator(mode="after")
    def _says_something(self) -> EventTypeRetry:
        if self.schedule is None and self.max_attempts is None:
            raise ValueError("give 'schedule', 'max_attempts' or both")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore", frozen=True)

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL; unset means start the embedded server in data_dir.",
    )
    data_dir: Path = Field(default_factory=default_data_dir)
    secret_keys: str | None = Field(
        default=None,
        description="Keys for endpoint secrets: 'kid:base64-32-bytes,...'; the first encrypts.",
    )
    max_payload_bytes: int = Field(default=64 * 1024, gt=0)
    event_types: Literal["accept", "strict"] = Field(
        default="accept",
        description=(
            "Unknown event types (not in the catalogue): 'accept' publishes them unchecked, "
            "'strict' refuses them. publish() reads the same variable."
        ),
    )
    max_payload_depth: int = Field(
        default=64, ge=1, le=256, description="Deepest nesting publish() accepts in a payload."
    )
    # The event-type catalogue (outbox/schema_rules.py): caps checked when a schema is
    # added, and the time one payload's validation may take.
    max_schema_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Largest event-type schema (its JSON text) `event-types add` accepts.",
    )
    max_schema_depth: int = Field(
        default=32, ge=2, le=64, description="Deepest nesting of an event-type schema."
    )
    max_schema_keywords: int = Field(
        default=10_000,
        ge=10,
        le=1_000_000,
        description="Most keywords (object members, all levels) in an event-type schema.",
    )
    validation_budget_ms: float = Field(
        default=100.0,
        ge=1,
        le=10_000,
        description="Time one payload's schema validation may take; over it, it is refused.",
    )
    relay_batch_size: int = Field(default=500, gt=0, le=10_000)
    relay_poll_interval: float = Field(default=1.0, gt=0)
    worker_batch_size: int = Field(default=100, gt=0, le=10_000)
    worker_max_in_flight: int = Field(default=200, gt=0)
    worker_endpoint_share: float = Field(
        default=0.5, gt=0, le=1, description="Most of a worker's slots one endpoint may hold."
    )
    worker_poll_interval: float = Field(default=1.0, gt=0)
    request_timeout: float = Field(default=10.0, gt=0, description="Deadline of one attempt, s.")
    lease_seconds: float = Field(default=60.0, gt=0)
    retry_schedule: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_SCHEDULE)
    )
    retry_jitter: float = Field(
        default=0.2, ge=0, lt=1, description="Each retry delay is scaled by 1 +- this fraction."
    )
    retry_after_max: float = Field(
        default=3600.0, ge=1, le=86400, description="Longest Retry-After honoured, s."
    )
    event_type_retry: Annotated[dict[str, EventTypeRetry], NoDecode] = Field(
        default_factory=dict,
        description=(
            'JSON: {"invoice.*": {"schedule": [60, 600], "max_attempts": 4}}; the most '
            "specific pattern wins; an endpoint's own policy wins over it."
        ),
    )
    max_rescues: int = Field(
        default=3,
        gt=0,
        le=100,
        description="Lease expiries a delivery survives before it is dead as a likely poison.",
    )
    max_attempts: int = Field(default=8, gt=0, le=100)
    allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="CIDRs the SSRF guard lets deliveries reach, e.g. '127.0.0.0/8'.",
    )
    https_only: bool = Field(default=False, description="Refuse http:// endpoints.")
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR.")
    log_format: Literal["text", "json"] = Field(
        default="text", description="'json' writes one JSON object per log line."
    )
    log_summary_interval: float = Field(
        default=60.0,
        ge=0,
        description="`outbox run` logs a one-line summary this often, s; 0 = never.",
    )
    # Endpoint health (delivery/health/): circuit breaker, ramp, 429 pause, auto-disable.
    breaker_failure_threshold: int = Field(
        default=5, gt=0, description="Consecutive failures that open an endpoint's breaker."
    )
    breaker_failure_ratio: float = Field(
        default=0.5, gt=0, le=1, description="Failure share over the window that opens it."
    )
    breaker_window_seconds: float = Field(default=60.0, gt=0)
    breaker_min_attempts: int = Field(
        default=20, gt=0, description="Attempts in the window before the ratio counts."
    )
    breaker_cooldown_seconds: float = Field(
        default=15.0, gt=0, description="Open time after a first trip; doubles per re-trip."
    )
    breaker_cooldown_max_seconds: float = Field(default=600.0, gt=0)
    ramp_seconds: float = Field(
        default=60.0, ge=0, description="After recovery or a 429 pause, the rate ramps this long."
    )
    ramp_start_per_second: float = Field(default=1.0, gt=0)
    ramp_step_per_second: float = Field(
        default=1.0, ge=0, description="The ramp's rate grows by this much every second."
    )
    throttle_seconds: float = Field(
        default=5.0, gt=0, description="Pause after a 429 without a usable Retry-After."
    )
    auto_disable_after_days: float = Field(
        default=5.0, gt=0, description="Disable an endpoint whose attempts all failed this long."
    )
    adaptive_algorithm: Literal["aimd", "gradient"] = Field(
        default="gradient",
        description="The limiter of endpoints with adaptive concurrency: 'gradient' or 'aimd' "
        "(docs/performance.md has both measured).",
    )
    adaptive_default_max: int = Field(
        default=100,
        description="Ceiling of an adaptive endpoint's in-flight limit when it has no "
        "max_in_flight of its own. 100: what one worker process gives one endpoint at most "
        "with the defaults (OUTBOX_WORKER_MAX_IN_FLIGHT 200 * OUTBOX_WORKER_ENDPOINT_SHARE 0.5).",
    )
    http_transport: Literal["wire", "httpx"] = Field(
        default="wire",
        description=(
            "Wire under httpx: 'wire' (our own HTTP/1.1, fastest, the production path) or "
            "'httpx' (httpcore's own pool)."
        ),
    )
    http_proxy: SecretStr | None = Field(
        default=None,
        description=(
            "Egress proxy for every delivery: http://user:password@host:port (an endpoint's "
            "own proxy wins). HTTPS goes through CONNECT to the address the SSRF guard checked."
        ),
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto",
        description="Event loop of `outbox run`: 'auto' = uvloop when installed, else asyncio.",
    )

    # Operator tools (issue 5): retention, the admin HTTP API, alert thresholds.
    retention_days: float = Field(
        default=7.0, ge=0, description="Prune finished history older than this; 0 = never."
    )
    dead_retention_days: float = Field(
        default=30.0, ge=0, description="Prune dead deliveries nobody replayed; 0 = never."
    )
    retention_batch_size: int = Field(default=500, gt=0, le=10_000)
    retention_interval: float = Field(default=60.0, gt=0)
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=8181, ge=0, le=65535)
    admin_metrics_public: bool = False
    admin_max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest admin API request body; a larger one is answered 413 unread.",
    )
    admin_refused_interval_seconds: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Refused calls from one client for one reason share one audit row per this.",
    )
    admin_unauthenticated_per_minute: float = Field(
        default=60.0,
        gt=0,
        le=1_000_000,
        description="Calls a client without a valid token may make per minute before 429.",
    )
    audit_retention_days: float = Field(
        default=90.0, ge=0, description="Prune audit rows older than this; 0 = never."
    )
    stats_window_seconds: float = Field(default=3600.0, gt=0)
    alert_dead_per_window: int = Field(default=10, gt=0)
    alert_repeated_error_deliveries: int = Field(default=20, gt=0)
    alert_oldest_due_seconds: float = Field(default=900.0, gt=0)
    alert_relay_lag_seconds: float = Field(default=60.0, gt=0)
    replay_rate_per_minute: float = Field(default=600.0, gt=0)
    # The web console and the tenant portal (delivery/operator/console).
    public_url: str | None = Field(
        default=None,
        description="Base URL the admin server is reached at (portal links print in full).",
    )
    console_app_name: str = Field(
        default="webhook-outbox", min_length=1, max_length=60, description="Shown in the pages."
    )
    console_brand_color: str = Field(default="#2f5bea", description="Header colour, #rrggbb.")
    portal_brand: str | None = Field(
        default=None,
        min_length=1,
        max_length=60,
        description="The name the tenant portal's header shows (unset: the app name).",
    )
    portal_frame_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Origins that may embed the portal in an iframe, e.g. https://app.example.",
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Addresses or CIDRs of reverse proxies in front of the admin server, e.g. "
            "'10.0.0.5,192.168.1.0/24'. Only their X-Forwarded-For names the client; "
            "empty: every client is its TCP peer."
        ),
    )

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        name = value.strip().upper()
        if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("is not a log level; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return name

    @field_validator(
        "retry_schedule",
        "allowed_networks",
        "portal_frame_origins",
        "trusted_proxies",
        mode="before",
    )
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("retry_schedule")
    @classmethod
    def _schedule_sane(cls, value: list[float]) -> list[float]:
        return check_retry_schedule(value)

    @field_validator("event_type_retry", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if not value.strip():
            return {}
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(
                f"is not valid JSON ({exc}); expected an object such as "
                '{"invoice.*": {"schedule": [60, 600], "max_attempts": 4}}'
            ) from exc

    @field_validator("event_type_retry")
    @classmethod
    def _patterns_valid(cls, value: dict[str, EventTypeRetry]) -> dict[str, EventTypeRetry]:
        # Imported here: endpoints pulls in the database layer, settings must stay light.
        from outbox.endpoints import parse_event_patterns

        for pattern in value:
            try:
                parse_event_patterns([pattern])
            except EndpointError as exc:
                raise ValueError(str(exc)) from exc
        return value

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip().rstrip("/")
        if not _PUBLIC_URL.match(value):
            raise ValueError(
                f"{value!r} must be a base URL like https://outbox.example.com (no query)"
            )
        return value

    @field_validator("http_proxy")
    @classmethod
    def _http_proxy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        try:
            parse_proxy_url(value.get_secret_value().strip(), what="the proxy URL")
        except InvalidEndpointURLError as exc:
            raise ValueError(str(exc)) from None  # the message never repeats the URL
        return SecretStr(value.get_secret_value().strip())

    @model_validator(mode="after")
    def _proxy_needs_the_wire(self) -> Settings:
        if self.http_proxy is not None and self.http_transport != "wire":
            raise ValueError(
                "OUTBOX_HTTP_PROXY needs OUTBOX_HTTP_TRANSPORT=wire (the default); the httpx "
                "transport sends directly"
            )
        return self

    @field_validator("console_app_name", "portal_brand")
    @classmethod
    def _app_name(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError("must be printable text, without control characters")
        return value

    @field_validator("console_brand_color")
    @classmethod
    def _brand_color(cls, value: str) -> str:
        if not _COLOR.match(value):
            raise ValueError(f"{value!r} must be a colour like #2f5bea")
        return value

    @field_validator("portal_frame_origins")
    @classmethod
    def _frame_origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if not _ORIGIN.match(origin):
                raise ValueError(
                    f"{origin!r} must be a scheme and host without a path, e.g. "
                    "https://app.example.com"
                )
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        networks = []
        for item in value:
            try:
                networks.append(str(ipaddress.ip_network(item, strict=True)))
            except ValueError as exc:
                raise ValueError(
                    f"{item!r} is not an IP address or network ({exc}); list proxies as "
                    "addresses or CIDRs like '10.0.0.5,192.168.1.0/24' (no host names)"
                ) from exc
        return networks

    @field_validator("adaptive_default_max")
    @classmethod
    def _adaptive_ceiling(cls, value: int) -> int:
        if not 1 <= value <= MAX_ADAPTIVE_DEFAULT_MAX:
            raise ValueError(
                f"{value} is not a usable ceiling for adaptive endpoints: give a whole number "
                f"from 1 to {MAX_ADAPTIVE_DEFAULT_MAX:,} (the default, 100, is one worker "
                "process's share for one endpoint)"
            )
        return value

    @model_validator(mode="after")
    def _lease_outlasts_deadline(self) -> Settings:
        if self.lease_seconds < self.request_timeout + LEASE_MARGIN_SECONDS:
            raise ValueError(
                f"OUTBOX_LEASE_SECONDS ({self.lease_seconds:g}) must exceed "
                f"OUTBOX_REQUEST_TIMEOUT ({self.request_timeout:g}) by at least "
                f"{LEASE_MARGIN_SECONDS:g}s, so a slow attempt is never rescued while it runs; "
                "raise the lease or lower the timeout"
            )
        return self

    @model_validator(mode="after")
    def _dead_kept_longer(self) -> Settings:
        if self.dead_retention_days and self.dead_retention_days < self.retention_days:
            raise ValueError(
                f"dead_retention_days ({self.dead_retention_days}) must be 0 (keep) or at least "
                f"retention_days ({self.retention_days}): dead letters are kept longer"
            )
        return self


def load_settings(**overrides: Any) -> Settings:
    """Read settings from the environment (and OUTBOX_ENV_FILE), with one clear error."""
    env_file = os.environ.get("OUTBOX_ENV_FILE")
    if env_file and not Path(env_file).is_file():
        raise ConfigurationError(f"OUTBOX_ENV_FILE={env_file!r} does not exist; fix or unset it")
    try:
        return Settings(_env_file=env_file, **overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = [str(part) for part in err["loc"]]
            # The variable in upper case, the path inside its value as written.
            env = ".".join([f"OUTBOX_{loc[0].upper()}", *loc[1:]]) if loc else "settings"
            problems.append(f"{env}: {err['msg']}")
        # One line, so the operator sees every problem at once and nothing scrolls away.
        raise ConfigurationError("invalid settings: " + "; ".join(problems)) from exc
