"""`outbox demo`, the README's first command, really delivers, retries and signs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from delivery.operator import demo
from delivery.operator.cli import main


@pytest.mark.slow  # its own embedded server
def test_demo_delivers_retries_and_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "DEMO_SECONDS", 4.0)
    result = CliRunner().invoke(main, ["demo"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "the healthy partner received 4 requests" in result.output
    assert "signature verifies with the endpoint secret: yes" in result.output
    assert "retrying: HTTP 500" in result.output
    assert "succeeded" in result.output
    # Five 500s in a row open the failing partner's breaker within the tour.
    assert "circuit breaker open" in result.output
