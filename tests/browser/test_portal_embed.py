"""The portal inside another application's page, in a real Chromium: framing follows
OUTBOX_PORTAL_FRAME_ORIGINS (and the operator console is never framed)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from delivery.operator.console.config import ConsoleConfig
from tests.browser.site import Site


class ParentPage:
    """The application's own page, on another origin, embedding `frame_src` in an iframe."""

    def __init__(self) -> None:
        self.frame_src = "about:blank"
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (
                    f'<!doctype html><title>shop</title><iframe src="{owner.frame_src}" '
                    'width="900" height="500"></iframe>'
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def parent() -> Iterator[ParentPage]:
    served = ParentPage()
    yield served
    served.close()


@pytest.fixture(params=[False, True], ids=["not-configured", "configured"])
def allowed(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def console_config(parent: ParentPage, allowed: bool) -> ConsoleConfig:
    """Overrides tests/browser/conftest.py's: the parent page's origin is allowed, or not."""
    return ConsoleConfig(frame_origins=(parent.origin,) if allowed else ())


def _frame_text(page: Any) -> str:
    frame = page.frames[1] if len(page.frames) > 1 else None
    if frame is None or frame.url.startswith("chrome-error"):
        return ""
    return str(frame.evaluate("document.body ? document.body.innerText : ''"))


def test_chromium_frames_the_portal_only_for_the_configured_parent(
    site: Site, page: Any, parent: ParentPage, allowed: bool
) -> None:
    parent.frame_src = f"{site.base_url}/portal/endpoints"
    page.goto(parent.origin + "/")
    page.wait_for_load_state("load")
    page.wait_for_timeout(200)
    text = _frame_text(page)
    if allowed:
        # The portal renders inside the application's page (no session here: it asks for
        # a link; a real embed opens the link inside the frame).
        assert "Ask for a new link" in text, (text, page.problems)
    else:
        assert "Ask for a new link" not in text
    # The operator console is never framed, even by an allowed parent.
    parent.frame_src = f"{site.base_url}/console/login"
    page.goto(parent.origin + "/")
    page.wait_for_load_state("load")
    page.wait_for_timeout(200)
    assert "Sign in" not in _frame_text(page)
