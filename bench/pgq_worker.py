"""The peer: what a Python user would glue together from pgqueuer instead.

The application enqueues one pgqueuer job per (event, endpoint) in its own
transaction (bench.producer); this process dequeues them and sends the very same
signed POST as our worker (`delivery.http.send_attempt`, the same Standard
Webhooks signature, the same HTTP client and transport), so the comparison is about
the queue, not the wire. A failed attempt raises, and pgqueuer's own failure
handling takes over.

Run as `python -m bench.pgq_worker URL SECRET --batch N --concurrency N --transport T`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

import psycopg
from pgqueuer import PsycopgDriver, QueueManager
from pgqueuer.models import Job
from pgqueuer.queries import Queries

from delivery.http import OutgoingRequest, build_http_client, send_attempt
from delivery.policy import Outcome
from outbox.clock import SystemClock
from outbox.crypto import secret_key_bytes
from outbox.db import libpq_url

ENTRYPOINT = "deliver"


class DeliveryFailedError(Exception):
    """Raised so pgqueuer records the job as failed."""


async def work(url: str, secret: str, batch: int, concurrency: int, transport: str) -> None:
    key = secret_key_bytes(secret)
    clock = SystemClock()
    connection = await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True)
    manager = QueueManager(Queries(PsycopgDriver(connection)))
    # The receiver is on loopback, which the SSRF guard refuses unless allowed.
    http = build_http_client(
        max_connections=concurrency,
        timeout=10.0,
        transport=transport,
        allowed_networks=("127.0.0.0/8",),
    )

    @manager.entrypoint(ENTRYPOINT)
    async def deliver(job: Job) -> None:
        assert job.payload is not None
        data = json.loads(job.payload)
        request = OutgoingRequest(
            delivery_id=int(job.id),
            url=data["url"],
            message_id=data["id"],
            body=data["body"].encode(),
            keys=[key],
            timeout=10.0,
        )
        result = await send_attempt(http, request, clock)
        if result.outcome is not Outcome.SUCCEEDED:
            raise DeliveryFailedError(result.error or "delivery failed")

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, manager.shutdown.set)
    try:
        await manager.run(batch_size=batch, max_concurrent_tasks=concurrency)
    finally:
        await http.aclose()
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("secret")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--transport", default="wire")
    args = parser.parse_args()
    asyncio.run(work(args.url, args.secret, args.batch, args.concurrency, args.transport))


if __name__ == "__main__":
    main()
