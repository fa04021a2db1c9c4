"""One log line when PostgreSQL goes away and one when it is back, not a traceback per poll.

Every loop of the service (relay, workers, reaper, retention, the LISTEN connection)
retries on its own after a database error, so an outage needs no action from the
code, only a clear account for the operator: when it began, what the error was, and
how long it lasted. The loops report to one `OutageLog` per process: the first
failure that looks like a lost connection logs one ERROR line, later ones only at
DEBUG, and the first success afterwards logs one WARNING line with the duration.

An error that is not about reaching the server (a bug, a constraint violation) is
not an outage: it is logged with its traceback every time, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

log = logging.getLogger("outbox.database")


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that mean "the server is unreachable", whatever layer raised them."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    return isinstance(exc, ConnectionError | TimeoutError)


def first_line(exc: BaseException) -> str:
    """The driver's own message, first line only (SQLAlchemy appends SQL and a link)."""
    inner = getattr(exc, "orig", None) or exc
    text = str(inner).strip() or type(inner).__name__
    return text.splitlines()[0]


class OutageLog:
    """Tracks whether the database is reachable, as seen by this process's loops."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._down_since: float | None = None
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, where: str, exc: BaseException) -> None:
        """A loop's database work raised `exc`; log it once per outage (or as a bug)."""
        if not is_connection_error(exc):
            log.error("%s failed; retrying", where, exc_info=exc)
            return
        self._failures += 1
        if self._down_since is None:
            self._down_since = self._monotonic()
            log.error(
                "PostgreSQL unreachable (%s: %s); every loop keeps retrying, "
                "one line follows when it is back",
                where,
                first_line(exc),
            )
        else:
            log.debug("%s: PostgreSQL still unreachable: %s", where, first_line(exc))

    def succeeded(self) -> None:
        """A loop's database work went through: end the outage, if one was running."""
        if self._down_since is None:
            return
        lasted = self._monotonic() - self._down_since
        failures, self._down_since, self._failures = self._failures, None, 0
        log.warning(
            "PostgreSQL reachable again after %.1fs (%d failed tries meanwhile)", lasted, failures
        )


# The one instance the service's loops share within a process (each worker process
# of `outbox run --processes N` has its own, and reports its own outage lines).
OUTAGE = OutageLog()
