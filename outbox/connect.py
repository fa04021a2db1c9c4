"""`outbox.database_url()`: where application code finds the outbox's database.

With OUTBOX_DATABASE_URL set, that URL (normalised to the psycopg 3 driver, so
`create_engine(url)` works as is). Without it, the embedded PostgreSQL in
OUTBOX_DATA_DIR, the very server the `outbox` command uses: started if it is not
running, migrated to the current schema, and held by this process until it exits
(the server stops when its last user, this process or an `outbox` command, exits).
"""

from __future__ import annotations

import threading
from pathlib import Path

from outbox.db import make_engine, sqlalchemy_url
from outbox.embedded import EmbeddedPostgres
from outbox.settings import load_settings

_lock = threading.Lock()
_servers: dict[Path, tuple[EmbeddedPostgres, str]] = {}


def database_url() -> str:
    """The SQLAlchemy URL of the outbox's database, starting the embedded server if needed.

    A database you run yourself (OUTBOX_DATABASE_URL) is returned as configured and
    never migrated here: `outbox migrate` is the one thing that changes it. Raises
    `ConfigurationError` for bad settings and `DatabaseUnavailableError` if the
    embedded server cannot start.
    """
    settings = load_settings()
    if settings.database_url:
        return sqlalchemy_url(settings.database_url)
    data_dir = settings.data_dir.resolve()
    with _lock:
        known = _servers.get(data_dir)
        if known is not None:
            return known[1]
        server = EmbeddedPostgres(data_dir)  # without the 'embedded' extra: says to install it
        url = sqlalchemy_url(server.start())
        from outbox.migrate import upgrade  # alembic: only the embedded server is migrated here

        engine = make_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        _servers[data_dir] = (server, url)
        return url
