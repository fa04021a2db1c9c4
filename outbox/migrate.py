"""Schema migrations (Alembic, with its own version table `outbox_alembic_version`).

Migrations run online, on a database that is publishing and delivering: each one in
its own transaction (a failure keeps every earlier one), every statement under a short
`lock_timeout` so a DDL step waiting behind a long transaction never queues the
application's writes behind it, and a step that cannot get its lock is retried with
backoff and then reported. Index builds run `CONCURRENTLY` in an autocommit block
(`op.get_context().autocommit_block()`); such a migration must be safe to run again
from the top (IF NOT EXISTS / IF EXISTS, invalid leftovers dropped), since a retry
starts it over.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from outbox.errors import ConfigurationError, OutboxError
from outbox.sql import migrations as queries

VERSION_TABLE = "outbox_alembic_version"
DISTRIBUTION = "webhook-outbox"

log = logging.getLogger(__name__)

# SQLSTATEs that mean "the lock was not had in time": retried, the migration starts over.
_LOCK_NOT_AVAILABLE = "55P03"
_DEADLOCK_DETECTED = "40P01"


# What the lock error tells a DBA to run: the oldest open transactions first.
FIND_LONG_TRANSACTIONS = (
    "SELECT pid, now() - xact_start AS age, state, query FROM pg_stat_activity"
    " WHERE xact_start IS NOT NULL ORDER BY xact_start"
)


class MigrationLockError(OutboxError):
    """A migration could not take its locks within lock_timeout, however often it tried."""


@dataclass(frozen=True, slots=True)
class LockPolicy:
    """How long one DDL statement may wait for a lock, and how often a migration retries.

    A short wait matters more than a sure one: while an `ALTER TABLE` waits for its lock,
    every later writer of that table waits behind it. Backoff doubles from
    `first_backoff` up to `max_backoff` seconds between tries.
    """

    lock_timeout: float = 2.0
    retries: int = 8
    first_backoff: float = 0.5
    max_backoff: float = 15.0
    # How long to wait for another `outbox migrate` on the same database to finish.
    wait_for_other_run: float = 600.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        return float(min(self.max_backoff, self.first_backoff * 2 ** (attempt - 1)))


@dataclass(frozen=True, slots=True)
class Step:
    """One applied migration: which, how long it took, and how many tries it needed."""

    revision: str
    title: str
    seconds: float
    attempts: int
    direction: Literal["upgrade", "downgrade"] = "upgrade"


@dataclass(frozen=True, slots=True)
class LockWait:
    """A try that did not get its lock; the runner waits `delay` seconds and starts over.

    `revision` is "-" while waiting for another `outbox migrate` on the same database.
    """

    revision: str
    attempt: int
    delay: float
    error: str


@dataclass(frozen=True, slots=True)
class SchemaState:
    """Where a database's schema is, next to what this release needs.

    `state` is "current" (at this release's head), "pending" (migrations of this release
    to run: `pending` lists them) or "newer" (a revision this release does not know: a
    later release migrated it; a release works against the next one's schema, see the
    docs/operating.md, Upgrading).
    """

    current: str | None
    needed: str
    pending: tuple[str, ...]
    state: Literal["current", "pending", "newer"]

    @property
    def usable(self) -> bool:
        return self.state != "pending"


def release_version() -> str:
    """This release's version: pyproject.toml's, as installed (one source)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a bare checkout on sys.path
        return "unknown"


def migrations_dir() -> Path:
    """Installed wheels carry migrations inside the package; a checkout keeps them at the top."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise ConfigurationError("migrations/ not found next to the outbox package; reinstall it")


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("version_table", VERSION_TABLE)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    """Parsed once per process: /readyz asks on every probe."""
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    head = _scripts().get_current_head()
    if head is None:  # pragma: no cover - the package ships its migrations
        raise ConfigurationError("no migrations found; reinstall webhook-outbox")
    return head


def _title(script: Script) -> str:
    return (script.doc or "").strip().splitlines()[0] if script.doc else script.revision


def schema_state(current: str | None) -> SchemaState:
    """`current` (a database's revision) judged against this release's migrations."""
    scripts, head = _scripts(), head_revision()
    if current == head:
        return SchemaState(current, head, (), "current")
    if current is not None and current not in {s.revision for s in scripts.walk_revisions()}:
        return SchemaState(current, head, (), "newer")
    pending = tuple(s.revision for s in _path(current, head))
    return SchemaState(current, head, pending, "pending")


def require_known_revision(revision: str, *, base: bool = False) -> None:
    """A revision a user typed is one of this release's (or "base" where that makes
    sense), or a one-line error."""
    known = [script.revision for script in _path(None, head_revision())]
    if revision not in known and not (base and revision == "base"):
        also = "'base' or " if base else ""
        raise ConfigurationError(
            f"{revision[:40]!r} is not a revision of this release: give "
            f"{also}one of {known[0]}..{known[-1]}"
            " (`outbox migrate --check` shows the database's)"
        )


def _path(current: str | None, target: str) -> list[Script]:
    """The migrations from `current` (exclusive) up to `target`, oldest first."""
    scripts = _scripts()
    return list(reversed(list(scripts.iterate_revisions(target, current or "base"))))


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return _read_revision(connection)


def _read_revision(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    revision = context.get_current_revision()
    connection.commit()  # alembic must find the connection outside a transaction
    return revision


def upgrade(
    engine: Engine,
    revision: str = "head",
    *,
    policy: LockPolicy | None = None,
    on_step: Callable[[Step], None] | None = None,
    on_wait: Callable[[LockWait], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    timer: Callable[[], float] = time.perf_counter,
) -> list[Step]:
    """Bring the schema to `revision`, one migration at a time; running it again changes nothing.

    Each migration commits on its own, so a later failure keeps the earlier ones. A
    migration that hits `lock_timeout` (or a deadlock) is rolled back and retried after
    a backoff; after `policy.retries` retries `MigrationLockError` says what to do.
    """
    policy = policy or LockPolicy()
    with _migration_connection(engine, policy, on_wait, sleep) as connection:
        current = _read_revision(connection)
        if schema_state(current).state == "newer":
            log.info("schema at %s, newer than this release knows: nothing to do", current)
            return []
        target = head_revision() if revision == "head" else revision
        steps = []
        for script in _path(current, target):
            step = _apply(connection, script, "upgrade", policy, on_wait, sleep, timer)
            steps.append(step)
            if on_step is not None:
                on_step(step)
        return steps


def downgrade(
    engine: Engine,
    revision: str,
    *,
    policy: LockPolicy | None = None,
    on_step: Callable[[Step], None] | None = None,
    on_wait: Callable[[LockWait], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    timer: Callable[[], float] = time.perf_counter,
) -> list[Step]:
    """Take the schema back to `revision` ("base": nothing), one migration at a time."""
    policy = policy or LockPolicy()
    with _migration_connection(engine, policy, on_wait, sleep) as connection:
        current = _read_revision(connection)
        if current is None:
            return []
        scripts = _scripts()
        lower = None if revision == "base" else revision
        undo = list(scripts.iterate_revisions(current, lower or "base"))
        steps = []
        for script in undo:
            step = _apply(connection, script, "downgrade", policy, on_wait, sleep, timer)
            steps.append(step)
            if on_step is not None:
                on_step(step)
        return steps


@contextlib.contextmanager
def _migration_connection(
    engine: Engine,
    policy: LockPolicy,
    on_wait: Callable[[LockWait], None] | None,
    sleep: Callable[[float], None],
) -> Iterator[Connection]:
    """One connection for the whole run, with the session's timeouts set and reset, and
    the database's migration lock held, so two `outbox migrate` never interleave.

    Session level (not SET LOCAL) so they hold in every migration's transaction and in
    autocommit blocks alike; reset at the end, since the connection goes back to the pool.
    """
    with engine.connect() as connection:
        _take_migration_lock(connection, policy, on_wait, sleep)
        for statement in session_settings(policy):
            connection.execute(text(statement))
        connection.commit()
        try:
            yield connection
        finally:
            try:
                connection.rollback()
                connection.execute(queries.RELEASE_MIGRATION_LOCK)
                connection.execute(text("RESET lock_timeout"))
                connection.execute(text("RESET statement_timeout"))
                connection.commit()
            except Exception:
                # A session that cannot be put back (the server went away, say) is closed,
                # never pooled still holding the migration lock.
                connection.invalidate()
                raise


def _take_migration_lock(
    connection: Connection,
    policy: LockPolicy,
    on_wait: Callable[[LockWait], None] | None,
    sleep: Callable[[float], None],
) -> None:
    waited = 0.0
    attempt = 0
    while True:
        attempt += 1
        taken = connection.execute(queries.TRY_MIGRATION_LOCK).scalar_one()
        holder = None if taken else connection.execute(queries.MIGRATION_LOCK_HOLDER).scalar()
        connection.commit()
        if taken:
            return
        if waited >= policy.wait_for_other_run:
            raise MigrationLockError(
                f"another `outbox migrate` (PostgreSQL pid {holder}) has been migrating this"
                f" database for over {policy.wait_for_other_run:g}s: let it finish, then run"
                " this again (or end it with pg_cancel_backend if it is stuck)"
            )
        reason = f"another `outbox migrate` is running (PostgreSQL pid {holder})"
        if on_wait is not None:
            on_wait(LockWait("-", attempt, 1.0, reason))
        sleep(1.0)
        waited += 1.0


def session_settings(policy: LockPolicy) -> tuple[str, ...]:
    """What a migration session sets first, online and in the offline SQL alike.

    The wait for a lock is what must be short (a DDL statement waiting for its lock
    queues every later writer of the table behind it). The statement itself may take
    as long as the table needs: a concurrent index build on a big table takes minutes
    and holds no lock that blocks writes, and a role's own statement_timeout would
    cancel it half way and leave an INVALID index behind.
    """
    milliseconds = max(1, round(policy.lock_timeout * 1000))
    return (f"SET lock_timeout = {milliseconds}", "SET statement_timeout = 0")


def _apply(
    connection: Connection,
    script: Script,
    direction: Literal["upgrade", "downgrade"],
    policy: LockPolicy,
    on_wait: Callable[[LockWait], None] | None,
    sleep: Callable[[float], None],
    timer: Callable[[], float],
) -> Step:
    started = timer()
    attempt = 0
    while True:
        attempt += 1
        try:
            _run_one(connection, script, direction)
            connection.commit()
            break
        except DBAPIError as exc:
            connection.rollback()
            if getattr(exc.orig, "sqlstate", None) not in (_LOCK_NOT_AVAILABLE, _DEADLOCK_DETECTED):
                raise
            reason = str(exc.orig).strip().splitlines()[0]
            if attempt > policy.retries:
                raise MigrationLockError(
                    f"migration {script.revision} ({_title(script)}) could not take its locks:"
                    f" {attempt} tries, each waiting at most {policy.lock_timeout:g}s (last:"
                    f" {reason}). A long transaction holds a lock it needs; find it with"
                    f" `{FIND_LONG_TRANSACTIONS}`, let it finish (or end it), then run"
                    " `outbox migrate` again: the migrations before this one are applied"
                    " and stay applied."
                ) from exc
            delay = policy.backoff(attempt)
            wait = LockWait(script.revision, attempt, delay, reason)
            log.warning(
                "migration %s: %s; retrying in %.1fs (try %d of %d)",
                script.revision,
                reason,
                delay,
                attempt + 1,
                policy.retries + 1,
            )
            if on_wait is not None:
                on_wait(wait)
            sleep(delay)
    return Step(script.revision, _title(script), timer() - started, attempt, direction)


def _run_one(
    connection: Connection, script: Script, direction: Literal["upgrade", "downgrade"]
) -> None:
    # One line of history (a test checks it): a down revision is never a merge's tuple.
    target = script.revision if direction == "upgrade" else str(script.down_revision or "base")
    _run_alembic(alembic_config(connection), direction, target)


def _run_alembic(
    config: Config,
    direction: Literal["upgrade", "downgrade"],
    target: str,
    *,
    start: str | None = None,
    sql: bool = False,
) -> None:
    """What `alembic.command.upgrade`/`downgrade` do, on the migrations parsed once per
    process (`_scripts()`): each command reads and runs every migration file again, and
    `upgrade` calls one per migration (from an empty database: some two thousand files)."""
    scripts = _scripts()

    def revisions(current: Any, context: MigrationContext) -> Any:
        if direction == "upgrade":
            return scripts._upgrade_revs(target, current)
        return scripts._downgrade_revs(target, current)

    with EnvironmentContext(
        config, scripts, fn=revisions, as_sql=sql, starting_rev=start, destination_rev=target
    ):
        scripts.run_env()


def offline_sql(start: str | None, end: str = "head", *, policy: LockPolicy | None = None) -> str:
    """The SQL `upgrade` would run from `start` (None: an empty database) to `end`.

    Nothing is read from or written to a database (Alembic's offline mode); steps
    that look at the database first (an invalid index left by a failed build, say)
    appear as the checks that guard them.
    """
    policy = policy or LockPolicy()
    for given in (start, end):
        if given is not None and given != "head":
            require_known_revision(given, base=given is start)
    buffer = io.StringIO()
    config = Config(output_buffer=buffer)
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("version_table", VERSION_TABLE)
    config.attributes["session_settings"] = session_settings(policy)
    end = head_revision() if end == "head" else end
    _run_alembic(config, "upgrade", end, start=start, sql=True)
    return buffer.getvalue()


def offline_sql_per_migration() -> Iterator[tuple[str, str]]:
    """(revision, its SQL) for every migration, oldest first: what the linter reads."""
    for script in _path(None, head_revision()):
        yield script.revision, offline_sql(script.down_revision, script.revision)  # type: ignore[arg-type]
