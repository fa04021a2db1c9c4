"""One validation layer for operator input, shared by the CLI and the admin API.

Everything an operator types (CLI arguments, query strings, JSON bodies) goes
through these models before it reaches `outbox.deliveries`, `outbox.endpoints` or
the database, so both doors refuse the same things with the same one-line message:

- integers are integers: `true`, `1.5`, `"1e3"` and full-width digits (U+FF11, which
  Python's `int()` would accept) are refused, and every id fits PostgreSQL's bigint;
- text has no NUL, control character or lone surrogate (PostgreSQL refuses NUL,
  a terminal would interpret the rest) and has a length limit;
- numbers are finite and within a range that means something (a replay rate of
  1e-300 per minute or a grace period of 1e300 seconds is a typo, not a wish);
- enums are enums; negative windows and zero limits are refused, not rounded.

A refusal is an `InputError` (an `OperationError`): the CLI prints it as one line,
the API answers 400 with it, and nothing has been written.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    TypeAdapter,
    ValidationError,
)

from delivery.health.limits import MAX_IN_FLIGHT
from outbox import deliveries as delivery_ops
from outbox.endpoint_auth import MAX_PEM_BYTES
from outbox.endpoint_rules import MAX_ENDPOINT_TIMEOUT_SECONDS
from outbox.errors import OperationError
from outbox.feeds import MAX_PAGE as MAX_FEED_PAGE
from outbox.filters import MAX_FILTER_LENGTH
from outbox.owners import check_owner
from outbox.publish import MAX_SUBJECT
from outbox.workflows import check_rate, check_seconds

MAX_ID = 2**63 - 1  # PostgreSQL bigint
MAX_WINDOW_SECONDS = 366 * 86400
MAX_GRACE_SECONDS = 90 * 86400
MIN_REPLAY_RATE, MAX_REPLAY_RATE = 0.1, 1_000_000.0
MAX_BULK = 100_000
MAX_TEXT = 500
MAX_REASON = 2000
MAX_IDS = 10_000

_ASCII_INTEGER = re.compile(r"^[+-]?[0-9]{1,30}$")
_ASCII_NUMBER = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$")


class InputError(OperationError):
    """Operator input broke a rule; the message names the field and says what to give."""


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be a whole number, not true/false")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _ASCII_INTEGER.match(value.strip()):
        return int(value.strip())
    raise ValueError(f"must be a whole number written with the digits 0-9, not {value!r:.40}")


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and _ASCII_NUMBER.match(value.strip()):
        number = float(value.strip())
    else:
        raise ValueError(f"must be a number written with the digits 0-9, not {value!r:.40}")
    if not math.isfinite(number):
        raise ValueError("must be a finite number")
    return number


def bad_character(value: str) -> str | None:
    """The first NUL, control character or lone surrogate in `value`, described; else None."""
    for index, char in enumerate(value):
        if unicodedata.category(char) in ("Cc", "Cs"):
            kind = "NUL" if char == "\x00" else f"control character U+{ord(char):04X}"
            if unicodedata.category(char) == "Cs":
                kind = f"lone surrogate U+{ord(char):04X}"
            return f"{kind} at position {index}"
    return None


def nul_in(document: Any) -> str | None:
    """Where the first NUL in a parsed JSON document is (`filter.error`, `ids[2]`), else None.

    PostgreSQL stores no NUL in text or jsonb, so a body holding one is refused whole,
    whatever route it is for. Iterative: a deep document cannot exhaust the stack.
    """
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return where or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                if "\x00" in str(key):
                    return path
                stack.append((item, path))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]") for index, item in enumerate(value))
    return None


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, not {_json_type(value)}")
    bad = bad_character(value)
    if bad is not None:
        raise ValueError(f"contains a {bad}: remove it")
    return value


def _owner(value: Any) -> str:
    """A team name (outbox.owners): the same rule wherever an owner is given."""
    try:
        return check_owner(_text(value))
    except OperationError as exc:
        raise ValueError(str(exc)) from exc


def _time(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        parsed = value
    elif isinstance(value, str) and bad_character(value) is None:
        try:
            parsed = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError as exc:
            raise ValueError("must be an ISO 8601 time, e.g. 2026-11-29T10:00:00Z") from exc
    else:
        raise ValueError("must be an ISO 8601 time, e.g. 2026-11-29T10:00:00Z")
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", bool: "true/false", type(None): "null"}
    for kind, name in names.items():
        if isinstance(value, kind):
            return name
    return "a number" if isinstance(value, int | float) else type(value).__name__


def _states(value: Any) -> Any:
    """'dead,discarded' (a query string or a CLI option) -> ['dead', 'discarded']."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        flat: list[Any] = []
        for item in value:
            flat.extend(_states(item) if isinstance(item, str) else [item])
        return flat
    return value


Id = Annotated[int, BeforeValidator(_integer), Field(ge=1, le=MAX_ID)]
Limit = Annotated[int, BeforeValidator(_integer), Field(ge=1, le=delivery_ops.MAX_PAGE)]
Text = Annotated[str, BeforeValidator(_text), Field(min_length=1, max_length=MAX_TEXT)]
Subject = Annotated[str, BeforeValidator(_text), Field(min_length=1, max_length=MAX_SUBJECT)]
Reason = Annotated[str, BeforeValidator(_text), Field(max_length=MAX_REASON)]
Time = Annotated[dt.datetime, BeforeValidator(_time)]
Owner = Annotated[str, BeforeValidator(_owner)]
State = Literal["scheduled", "in_flight", "succeeded", "dead", "discarded", "held"]
States = Annotated[tuple[State, ...], BeforeValidator(_states)]
WindowSeconds = Annotated[float, BeforeValidator(_number), Field(gt=0, le=MAX_WINDOW_SECONDS)]
GraceSeconds = Annotated[float, BeforeValidator(_number), Field(ge=0, le=MAX_GRACE_SECONDS)]
ReplayRate = Annotated[
    float, BeforeValidator(_number), Field(ge=MIN_REPLAY_RATE, le=MAX_REPLAY_RATE)
]
TimeoutSeconds = Annotated[
    float, BeforeValidator(_number), Field(gt=0, le=MAX_ENDPOINT_TIMEOUT_SECONDS)
]
Attempts = Annotated[int, BeforeValidator(_integer), Field(ge=1, le=100)]
# A payload filter (outbox/filters.py checks it in PostgreSQL); "" clears it.
PayloadFilter = Annotated[str, BeforeValidator(_text), Field(max_length=MAX_FILTER_LENGTH)]
DeliveryMode = Literal["push", "pull", "both"]
BulkCount = Annotated[int, BeforeValidator(_integer), Field(ge=1, le=MAX_BULK)]
MaxInFlight = Annotated[int, BeforeValidator(_integer), Field(ge=1, le=MAX_IN_FLIGHT)]


class _Input(BaseModel):
    # Unknown fields are refused: a misspelt "agian": true must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeliverySearch(_Input):
    """The delivery filter of `deliveries list`, `GET /v1/deliveries` and bulk replay."""

    state: States = Field(
        (),
        description="Comma-separated states: scheduled, in_flight, succeeded, dead, discarded, "
        "held.",
    )
    endpoint: Text | None = Field(None, description="Endpoint id.")
    event_type: Text | None = Field(None, description="Exact event type.")
    error: Text | None = Field(
        None, description="Text contained in the last error or any attempt's error (any case)."
    )
    message_id: Text | None = Field(
        None, description="The event's message id (the webhook-id header), e.g. msg_..."
    )
    subject: Subject | None = Field(
        None, description="The document the event is about, as published, e.g. invoice/inv_7."
    )
    since: Time | None = Field(None, description="Created at or after (ISO 8601).")
    until: Time | None = Field(None, description="Created before (ISO 8601).")
    unreplayed: StrictBool = Field(False, description="Only deliveries never replayed.")
    before: Id | None = Field(None, description="Paging: only ids below this (pass next_before).")
    limit: Limit = Field(50, description="Page size, 1..1000 (default 50).")
    owner: Owner | None = Field(
        None, description="Owner (team): the endpoint's owner, else the event type's."
    )

    def to_filter(self, *, tenant: str | None = None) -> delivery_ops.DeliveryFilter:
        """`tenant` is resolved by the caller (it must exist, and a scope wins)."""
        return delivery_ops.DeliveryFilter(
            tenant=tenant,
            owner=self.owner,
            states=self.state,
            endpoint=self.endpoint,
            event_type=self.event_type,
            error=self.error,
            message_id=self.message_id,
            subject=self.subject,
            since=self.since,
            until=self.until,
            unreplayed=self.unreplayed,
            before_id=self.before,
            limit=self.limit,
        )


class ReplayFilter(_Input):
    """What a bulk replay matches (dead deliveries unless `state` says otherwise)."""

    state: States = ()
    endpoint: Text | None = None
    event_type: Text | None = None
    error: Text | None = None
    message_id: Text | None = None
    subject: Subject | None = None
    since: Time | None = None
    until: Time | None = None
    owner: Owner | None = None
    # Checked by the tenant rules themselves when it is resolved (outbox.tenants).
    tenant: StrictStr | None = None

    def to_filter(self, *, tenant: str | None = None) -> delivery_ops.DeliveryFilter:
        """`tenant` is the resolved one (see DeliverySearch.to_filter), not `self.tenant`."""
        fields = self.model_dump(exclude={"tenant"})
        return DeliverySearch(**fields).to_filter(tenant=tenant)


_FORCE = (
    "Replay anyway: a succeeded delivery, or one a newer event of the same type and subject "
    "(or ordering key) superseded at its endpoint (refused without it, naming that event)."
)


class ReplayOne(_Input):
    reason: Reason = Field(description="Why; goes in the audit log (required).")
    force: StrictBool = Field(False, description=_FORCE)
    again: StrictBool = False


class ReplayMany(_Input):
    reason: Reason = Field(description="Why; goes in the audit log (required).")
    ids: Annotated[list[Id], Field(max_length=MAX_IDS)] | None = None
    filter: ReplayFilter | None = None
    dry_run: StrictBool = False
    force: StrictBool = Field(False, description=_FORCE)
    again: StrictBool = False
    max_count: BulkCount = delivery_ops.DEFAULT_BULK_LIMIT
    rate_per_minute: ReplayRate | None = None


class DiscardOne(_Input):
    reason: Reason = Field(description="Why; goes in the audit log (required).")


class HeldAction(_Input):
    """Confirm, retry or discard held deliveries (`deliveries confirm|retry|discard`)."""

    ids: Annotated[list[Id], Field(min_length=1, max_length=MAX_IDS)]
    reason: Reason = Field(description="Why; goes in the audit log (required).")


def _seconds(value: Any) -> float:
    return check_seconds(_number(value), "a threshold")


def _rate(value: Any) -> float:
    return check_rate(_number(value))


def _wrapped(check: Any) -> Any:
    """An outbox check's OperationError as the ValueError pydantic reports as a 400."""

    def run(value: Any) -> Any:
        try:
            return check(value)
        except OperationError as exc:
            raise ValueError(str(exc)) from exc

    return run


ThresholdSeconds = Annotated[float, BeforeValidator(_wrapped(_seconds))]
ErrorRate = Annotated[float, BeforeValidator(_wrapped(_rate))]
OnAmbiguous = Literal["retry", "hold"]


class FailurePolicy(_Input):
    """An endpoint's failure settings (PATCH /v1/endpoints/{uid}/failure-policy); a null
    owner clears it."""

    on_ambiguous: OnAmbiguous | None = Field(
        None, description="retry (default) or hold: an ambiguous outcome waits for a person."
    )
    owner: Owner | None = Field(None, description="The team its failures belong to.")
    operational_owner: Owner | None = Field(
        None, description="Take only this owner's operational events."
    )
    reason: Reason | None = None


class WorkflowSettings(_Input):
    """An event type's workflow (PATCH /v1/event-types/{name}/workflow); null clears."""

    on_ambiguous: OnAmbiguous | None = None
    owner: Owner | None = None
    alert_oldest_seconds: ThresholdSeconds | None = Field(
        None, description="Alert when its oldest due delivery has waited this long."
    )
    alert_error_rate: ErrorRate | None = Field(
        None, description="Alert when this share (0-1] of the window's attempts failed."
    )
    alert_processing_p95_seconds: ThresholdSeconds | None = Field(
        None, description="Alert when p95 from publish to delivered exceeds this."
    )


class DiscardMany(_Input):
    ids: Annotated[list[Id], Field(min_length=1, max_length=MAX_IDS)]
    reason: Reason = Field(description="Why; goes in the audit log (required).")


class DeliveryIds(_Input):
    """Ids typed on the command line (`replay 12 13`, `discard 12`)."""

    ids: Annotated[list[Id], Field(max_length=MAX_IDS)]


class EndpointCreate(_Input):
    url: Text
    event_types: Text | Annotated[list[Text], Field(min_length=1, max_length=100)]
    description: Reason = ""
    secret: Text | None = None
    signature: Literal["hmac", "ed25519"] | None = None  # None: hmac, or the secret's prefix
    tenant: StrictStr | None = None  # checked when resolved, by the tenant rules
    all_tenants: StrictBool = False
    # Its own egress proxy, http://user:password@host:port (stored encrypted).
    proxy: Text | None = None
    # push (HTTP POSTs), pull (the catch-up feed only) or both; a feed token is shown once.
    delivery_mode: DeliveryMode = "push"
    payload_filter: PayloadFilter | None = None
    # adaptive (the default): the worker finds its in-flight limit, up to
    # OUTBOX_ADAPTIVE_DEFAULT_MAX; fixed: no limit until one is set (PATCH .../concurrency)
    concurrency: Literal["adaptive", "fixed"] = "adaptive"


class EndpointUpdate(_Input):
    url: Text | None = None
    event_types: Text | Annotated[list[Text], Field(min_length=1, max_length=100)] | None = None
    description: Reason | None = None
    timeout_seconds: TimeoutSeconds | None = None
    max_attempts: Attempts | None = None
    reason: Reason | None = None
    # A proxy URL sets the endpoint's own proxy; an explicit null removes it.
    proxy: Text | None = None
    delivery_mode: DeliveryMode | None = None
    # A SQL/JSON path predicate; "" or an explicit null removes the filter.
    payload_filter: PayloadFilter | None = None

    @property
    def changes_fields(self) -> bool:
        """Whether anything but the proxy, mode and filter (and the reason) is to change."""
        return bool(self.model_fields_set - {"proxy", "reason", "delivery_mode", "payload_filter"})


class FeedQuery(_Input):
    """GET /feed/v1/{endpoint}: where to continue and how much to take."""

    after: Annotated[str, BeforeValidator(_text), Field(max_length=64)] | None = Field(
        None,
        description="The `next_cursor` of the previous page; leave it out to start at the "
        "oldest event kept.",
    )
    limit: Annotated[int, BeforeValidator(_integer), Field(ge=1, le=MAX_FEED_PAGE)] | None = Field(
        None, description=f"Items per page, 1 to {MAX_FEED_PAGE} (default 100)."
    )


class FeedTokenRotate(_Input):
    reason: Reason | None = None


# A certificate or key in PEM (line breaks allowed); checked by outbox.endpoint_auth.
Pem = Annotated[StrictStr, Field(min_length=1, max_length=MAX_PEM_BYTES)]


class OAuthClientInput(_Input):
    token_url: Text
    client_id: Text
    client_secret: Text
    scope: Text | None = None


class EndpointAuthUpdate(_Input):
    """A field given sets it, an explicit null removes it, a field left out is kept."""

    client_certificate: Pem | None = None  # the certificate chain, leaf first
    client_key: Pem | None = None  # its unencrypted private key
    oauth: OAuthClientInput | None = None
    reason: Reason | None = None


class ConcurrencyUpdate(_Input):
    """An endpoint's concurrency (PATCH /v1/endpoints/{uid}/concurrency); fields not
    given stay as they are."""

    mode: Literal["fixed", "adaptive"] | None = Field(
        None,
        description="adaptive: the in-flight limit follows the endpoint's latency and "
        "429/503 answers, between 1 and max_in_flight; fixed: max_in_flight is the limit.",
    )
    max_in_flight: MaxInFlight | None = Field(
        None,
        description="The fixed limit, or the adaptive limit's ceiling; null: no limit "
        "(adaptive: the default maximum, OUTBOX_ADAPTIVE_DEFAULT_MAX).",
    )
    reason: Reason | None = None


class EndpointAction(_Input):
    """Enable, disable: only a reason."""

    reason: Reason | None = None


class EndpointDisable(EndpointAction):
    """Disabling takes a reason (its audit row says why the deliveries wait)."""

    reason: Reason = Field(description="Why; goes in the audit log (required).")


class RotateSecret(_Input):
    grace_seconds: GraceSeconds | None = None
    secret: Text | None = None
    signature: Literal["hmac", "ed25519"] | None = None  # None: keep the endpoint's scheme
    reason: Reason | None = None


def _flag(value: Any) -> Any:
    """A query-string flag: true/false, 1/0, yes/no; anything else is refused, not False."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "yes"):
            return True
        if word in ("0", "false", "no"):
            return False
        raise ValueError("must be true or false")
    return value


class EndpointDelete(_Input):
    reason: Reason = Field(description="Why (required).")
    force: Annotated[StrictBool, BeforeValidator(_flag)] = Field(
        False, description="Delete pending ones too."
    )


class EndpointRef(_Input):
    uid: Text


class DeliveryRef(_Input):
    id: Id


class StatsQuery(_Input):
    window: WindowSeconds | None = Field(
        None, description="Window in seconds (default from settings)."
    )


class AuditQuery(_Input):
    actor: Text | None = Field(None, description="Exact actor.")
    action: Text | None = Field(
        None, description="Action or prefix (delivery, endpoint.update, api.refused)."
    )
    target: Text | None = Field(None, description="Target id.")
    since: Time | None = Field(None, description="At or after (ISO 8601).")
    before: Id | None = Field(None, description="Paging: only ids below this.")
    limit: Limit = Field(50, description="Page size (default 50).")


class NoInput(_Input):
    """A route that takes no query parameters."""


M = TypeVar("M", bound=BaseModel)


def _where(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not re.match(r"^(function-|constrained-|literal\[|tuple\[|list\[)", part):
            text += f".{part}" if text else part
    return text or "input"


def _message(err: Any) -> str:
    message = str(err["msg"])
    return message.removeprefix("Value error, ")


def parse(model: type[M], data: Mapping[str, Any] | None) -> M:
    """`data` as a `model`, or an InputError naming every field that is wrong."""
    if data is not None and not isinstance(data, Mapping):
        raise InputError(f"the input must be a JSON object, not {_json_type(data)}")
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _where(tuple(err["loc"]))
            if err["type"] == "extra_forbidden":
                known = ", ".join(model.model_fields)
                problems.append(f"{where}: unknown field (known: {known})")
            else:
                problems.append(f"{where}: {_message(err)}")
        raise InputError("; ".join(dict.fromkeys(problems))) from None


def given(**values: Any) -> dict[str, Any]:
    """Only the values that were given (not None, not empty): CLI options and query strings."""
    return {key: value for key, value in values.items() if value not in (None, "", (), [], {})}


_TEXT: TypeAdapter[str] = TypeAdapter(Text)
_INTEGER: TypeAdapter[int] = TypeAdapter(Annotated[int, BeforeValidator(_integer)])
_TIME: TypeAdapter[dt.datetime] = TypeAdapter(Time)


def integer_value(name: str, value: Any, *, ge: int = 0, le: int = MAX_ID) -> int:
    """One integer (a query parameter, a path segment) checked like the models' fields."""
    try:
        number = _INTEGER.validate_python(value)
    except ValidationError as exc:
        raise InputError(f"{name}: {_message(exc.errors()[0])}") from None
    if not ge <= number <= le:
        raise InputError(f"{name}: must be from {ge} to {le}")
    return number


def flag_value(name: str, value: Any) -> bool:
    try:
        return bool(_flag(value)) if isinstance(value, str) else _strict_bool(value)
    except ValueError as exc:
        raise InputError(f"{name}: {exc}") from None


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def time_value(name: str, value: Any) -> dt.datetime:
    try:
        return _TIME.validate_python(value)
    except ValidationError as exc:
        raise InputError(f"{name}: {_message(exc.errors()[0])}") from None


def text_option(name: str, value: str | None) -> str | None:
    """One free-text CLI option (--actor, an endpoint id) checked like any API text field."""
    if value is None:
        return None
    try:
        return _TEXT.validate_python(value)
    except ValidationError as exc:
        raise InputError(f"{name}: {_message(exc.errors()[0])}") from None
