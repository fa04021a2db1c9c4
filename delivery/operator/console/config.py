"""Settings of the console and portal pages, apart from the pages so the shared operator
context (delivery.operator.context) can hold them without importing the web layer."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

_COLOR = re.compile(r"^#[0-9a-fA-F]{6}$")
_ORIGIN = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$")


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    """Settings of the web pages (OUTBOX_CONSOLE_*), validated at the edge."""

    app_name: str = "webhook-outbox"
    brand_color: str = "#2f5bea"
    # The name the portal's header shows its tenants (OUTBOX_PORTAL_BRAND); app_name if unset.
    portal_brand: str | None = None
    # Origins allowed to embed the portal in an iframe (e.g. https://app.example.com).
    frame_origins: tuple[str, ...] = ()
    session_ttl: dt.timedelta = dt.timedelta(hours=8)
    portal_session_ttl: dt.timedelta = dt.timedelta(hours=1)
    link_ttl: dt.timedelta = dt.timedelta(minutes=15)
    # Logins and link exchanges per client address per minute.
    logins_per_minute: int = 10
    # Where the admin server is reached (OUTBOX_PUBLIC_URL): portal links print in full.
    public_url: str | None = None

    def __post_init__(self) -> None:
        if not _COLOR.match(self.brand_color):
            raise ValueError(f"brand colour {self.brand_color!r} must look like #2f5bea")
        for origin in self.frame_origins:
            if not _ORIGIN.match(origin):
                raise ValueError(
                    f"frame origin {origin!r} must be a scheme and host, e.g. https://app.example"
                )
