"""OpenTelemetry: the application's trace continues from publish() to every attempt.

Spans are recorded with the SDK's in-memory exporter. The send path also works with
the package absent (tracing off), checked both in-process and in a subprocess where
`opentelemetry` cannot be imported at all.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.http import build_http_client
from delivery.receiver import Receiver
from delivery.worker import Worker, WorkerConfig
from outbox import publish, tracing
from outbox.clock import ManualClock
from outbox.crypto import SecretBox
from outbox.relay import Relay
from tests.helpers import LOOPBACK, ROOT, add_endpoint, rows


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """A global SDK tracer provider for this test only (the API allows one per process)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE._done)
    trace._TRACER_PROVIDER_SET_ONCE._done = False
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE._done = saved
        provider.shutdown()


async def _deliver_twice(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
) -> None:
    """Relay, then one 503 attempt and one 200 attempt of the same delivery."""
    await Relay(async_engine, clock).run_until_idle()
    config = WorkerConfig(retry_schedule=(1.0,), retry_jitter=0)
    async with build_http_client(max_connections=4, timeout=5, allowed_networks=LOOPBACK) as http:
        worker = Worker(async_engine, http, box, clock, config)
        await worker.run_once()
        receiver.route("/hook", status=200)
        clock.advance(seconds=2)
        await worker.run_once()


async def test_the_applications_trace_continues_from_publish_to_each_attempt(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    exporter: InMemorySpanExporter,
) -> None:
    uid = add_endpoint(engine, box, receiver.route("/hook", status=503)).endpoint.uid
    tracer = trace.get_tracer("the-application")
    with tracer.start_as_current_span("checkout") as app_span, engine.begin() as conn:
        message_id = publish(conn, "order.created", {"order_id": 42})
    stored = rows(engine, "SELECT traceparent FROM outbox_events")[0]["traceparent"]
    await _deliver_twice(engine, async_engine, clock, box, receiver)

    spans = {span.name: span for span in exporter.get_finished_spans()}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "deliver order.created"]
    published = spans["publish order.created"]
    trace_id = app_span.get_span_context().trace_id
    # publish is a child of the application's span, and its context is what was stored.
    assert published.parent is not None
    assert published.parent.span_id == app_span.get_span_context().span_id
    assert published.kind is trace.SpanKind.PRODUCER
    assert published.attributes is not None
    assert published.attributes["messaging.message.id"] == message_id
    assert published.context is not None
    assert stored.startswith(f"00-{trace_id:032x}-{published.context.span_id:016x}-")
    # Each attempt is a CLIENT span in the same trace, child of the publish span.
    assert len(attempts) == 2
    for span in attempts:
        assert span.context is not None and span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == published.context.span_id
        assert span.kind is trace.SpanKind.CLIENT
        assert span.attributes is not None
        assert span.attributes["messaging.message.id"] == message_id
        assert span.attributes["webhook_outbox.endpoint"] == uid
    first, second = sorted(attempts, key=lambda s: s.start_time or 0)
    assert first.attributes is not None and second.attributes is not None
    assert (first.attributes["http.response.status_code"], first.status.status_code) == (
        503,
        trace.StatusCode.ERROR,
    )
    assert first.attributes["webhook_outbox.attempt"] == 1
    assert second.attributes["http.response.status_code"] == 200
    assert second.status.status_code is not trace.StatusCode.ERROR
    assert second.attributes["webhook_outbox.outcome"] == "succeeded"
    # The trace context stays inside: partners get only the Standard Webhooks headers.
    assert all("traceparent" not in request.headers for request in receiver.requests)


async def test_without_opentelemetry_the_send_path_works_and_stores_no_trace(
    engine: Engine,
    async_engine: AsyncEngine,
    clock: ManualClock,
    box: SecretBox,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "_trace", None)
    add_endpoint(engine, box, receiver.route("/hook", status=503))
    with engine.begin() as conn:
        publish(conn, "order.created", {"order_id": 42})
    await _deliver_twice(engine, async_engine, clock, box, receiver)
    assert rows(engine, "SELECT traceparent FROM outbox_events")[0]["traceparent"] is None
    assert rows(engine, "SELECT state FROM deliveries")[0]["state"] == "succeeded"
    assert len(receiver.requests) == 2


def test_the_package_imports_and_runs_without_opentelemetry_installed() -> None:
    script = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if not installed: importing it fails\n"
        "from outbox import tracing\n"
        "import delivery.worker, outbox.publish\n"
        "assert not tracing.available()\n"
        "with tracing.publish_span('order.created', 'default') as (span, parent):\n"
        "    assert (span, parent) == (None, None)\n"
        "span = tracing.start_attempt_span('00-' + '1' * 32 + '-' + '2' * 16 + '-01',\n"
        "    event_type='t', message_id='m', delivery_id=1, endpoint_uid='e', attempt=1)\n"
        "tracing.end_attempt_span(span, outcome='succeeded', status_code=200, error=None)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.stdout == "ok\n", done.stderr
