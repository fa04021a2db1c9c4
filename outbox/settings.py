"""Settings, validated once at the edge.

Every field is read from an `OUTBOX_`-prefixed environment variable, or from the
optional file named by `OUTBOX_ENV_FILE` (see config/outbox.example.env). Services
never see this class: the CLI turns it into the plain config objects they take.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from outbox.errors import ConfigurationError

DEFAULT_RETRY_SCHEDULE = (5.0, 60.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0)


def default_data_dir() -> Path:
    """Where the embedded PostgreSQL and the generated demo key live unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "webhook-outbox"


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


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
    relay_batch_size: int = Field(default=500, gt=0, le=10_000)
    relay_poll_interval: float = Field(default=1.0, gt=0)
    worker_batch_size: int = Field(default=100, gt=0, le=10_000)
    worker_max_in_flight: int = Field(default=200, gt=0)
    worker_poll_interval: float = Field(default=1.0, gt=0)
    request_timeout: float = Field(default=10.0, gt=0, description="Deadline of one attempt, s.")
    lease_seconds: float = Field(default=60.0, gt=0)
    retry_schedule: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_SCHEDULE)
    )
    max_attempts: int = Field(default=8, gt=0, le=100)
    allowed_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "INFO"
    http_transport: Literal["aiohttp", "httpx"] = Field(
        default="aiohttp",
        description="Wire under httpx: 'aiohttp' (fast) or 'httpx' (httpcore's own pool).",
    )

    @field_validator("retry_schedule", "allowed_networks", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("retry_schedule")
    @classmethod
    def _schedule_sane(cls, value: list[float]) -> list[float]:
        if not value:
            raise ValueError("must list at least one delay in seconds, e.g. '5,60,300'")
        if any(delay < 0 for delay in value):
            raise ValueError("delays must be zero or positive seconds")
        return value

    @model_validator(mode="after")
    def _lease_outlasts_deadline(self) -> Settings:
        if self.lease_seconds <= self.request_timeout:
            raise ValueError(
                f"lease_seconds ({self.lease_seconds}) must exceed request_timeout "
                f"({self.request_timeout}) so a slow attempt is never rescued while running"
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
            field = ".".join(str(part) for part in err["loc"]) or "settings"
            env = f"OUTBOX_{field.upper()}" if err["loc"] else "settings"
            problems.append(f"{env}: {err['msg']}")
        raise ConfigurationError("invalid settings:\n  " + "\n  ".join(problems)) from exc
