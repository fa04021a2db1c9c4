"""The raw ceiling's client (bench/drain.py `raw_ceiling`), in a module of its own.

It runs in a spawned process, which imports the module that defines the function it
is given: this one imports nothing but the standard library (aiohttp and uvloop
inside), so the child does not load the service, SQLAlchemy and pgqueuer (about two
CPU seconds) for a client that uses none of them. Nothing it measures changes: the
rate and CPU are taken inside the timed loop.
"""

from __future__ import annotations

import asyncio
import time


def client_in_process(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[int, float]:
    """(requests/s, client CPU ms per request) of a bare aiohttp client."""

    async def measure() -> tuple[int, float]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def post() -> None:
                async with session.post(url, data=body) as response:
                    await response.read()
                    response.raise_for_status()

            await asyncio.gather(*(post() for _ in range(concurrency)))  # open the pool
            done = 0
            stop_at = time.perf_counter() + seconds

            async def one() -> None:
                nonlocal done
                while time.perf_counter() < stop_at:
                    await post()
                    done += 1

            began, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(one() for _ in range(concurrency)))
            rate = round(done / (time.perf_counter() - began))
            return rate, round((time.process_time() - cpu) * 1000 / max(done, 1), 4)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(measure())
    return uvloop.run(measure())
