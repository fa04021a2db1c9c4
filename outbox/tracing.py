"""OpenTelemetry traces from `publish()` to every delivery attempt, when installed.

Optional: `pip install 'webhook-outbox[otel]'` brings `opentelemetry-api`; without
it every function here does nothing and costs one `None` check. The application
configures the SDK and exporter as it always does; this module only uses the
global tracer provider.

    application span
      └─ publish order.created      (PRODUCER, in the application's process)
           ├─ deliver order.created (CLIENT, in `outbox run`, attempt 1)
           └─ deliver order.created (CLIENT, attempt 2 ...)

`publish()` opens a short PRODUCER span as a child of whatever span is current and
stores its W3C `traceparent` in the event row; each attempt is a CLIENT span whose
parent is that `traceparent`, so the trace crosses the process boundary through
the database. The trace context is *not* sent to partners: their requests carry
only the Standard Webhooks headers.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the optional extra is not installed: tracing is off
    _trace = None  # type: ignore[assignment]

TRACER_NAME = "webhook-outbox"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def available() -> bool:
    return _trace is not None


# A provider named in the environment is loaded by the API on first use; then always ask it.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_UNSET = object()


def _recording() -> bool:
    """Whether an SDK is configured. Until the application sets a tracer provider, the
    API's proxy makes spans that record nothing: skipping them saves their cost per
    event and per attempt (a few percent of a busy worker's CPU).

    Read from the API's global rather than `get_tracer_provider()`, which looks the
    environment up on every call (that lookup alone cost 3 % of a draining worker).
    """
    if _trace is None:
        return False
    provider = getattr(_trace, "_TRACER_PROVIDER", _UNSET)
    if provider is _UNSET or (provider is None and _PROVIDER_FROM_ENV):
        provider = _trace.get_tracer_provider()  # an API without that global, or env
    return provider is not None and not isinstance(provider, _trace.ProxyTracerProvider)


def _tracer() -> Any:
    # Looked up per use (cheap), so a provider the application sets later is honoured.
    return _trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def publish_span(event_type: str, tenant: str) -> Iterator[tuple[Any, str | None]]:
    """A PRODUCER span around writing one event; yields (span, traceparent or None)."""
    if not _recording():
        yield None, None
        return
    with _tracer().start_as_current_span(
        f"publish {event_type}",
        kind=_trace.SpanKind.PRODUCER,
        attributes={
            "messaging.system": "webhook-outbox",
            "messaging.operation.type": "send",
            "messaging.destination.name": event_type,
            "webhook_outbox.tenant": tenant,
        },
    ) as span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        traceparent = carrier.get("traceparent")
        yield span, traceparent if traceparent and _TRACEPARENT.match(traceparent) else None


def set_message_id(span: Any, message_id: str) -> None:
    if span is not None:
        span.set_attribute("messaging.message.id", message_id)


def start_attempt_span(
    traceparent: str | None,
    *,
    event_type: str,
    message_id: str,
    delivery_id: int,
    endpoint_uid: str,
    attempt: int,
) -> Any:
    """A CLIENT span for one delivery attempt, child of the publishing span if known.

    Returns None when tracing is off; `end_attempt_span` accepts that.
    """
    if not _recording():
        return None
    parent = None
    if traceparent and _TRACEPARENT.match(traceparent):
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return _tracer().start_span(
        f"deliver {event_type}",
        context=parent,
        kind=_trace.SpanKind.CLIENT,
        attributes={
            "messaging.system": "webhook-outbox",
            "messaging.operation.type": "process",
            "messaging.message.id": message_id,
            "webhook_outbox.delivery_id": delivery_id,
            "webhook_outbox.endpoint": endpoint_uid,
            "webhook_outbox.attempt": attempt,
        },
    )


def end_attempt_span(
    span: Any, *, outcome: str, status_code: int | None, error: str | None
) -> None:
    if span is None:
        return
    span.set_attribute("webhook_outbox.outcome", outcome)
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
    if outcome != "succeeded":
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, error or outcome))
    span.end()
