"""The CLI: `outbox deliveries list --subject`, and `outbox replay` refusing a superseded
delivery unless --force (the dry run says how many it would leave out)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from delivery.operator.cli import main
from delivery.receiver import Receiver
from outbox import publish
from outbox.clock import ManualClock
from outbox.crypto import SecretBox, generate_key
from tests.helpers import add_endpoint, scalar
from tests.operator_helpers import deliver


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_SECRET_KEYS", generate_key("cli"))
    return CliRunner()


async def test_subject_filter_and_the_superseded_refusal(
    cli: CliRunner,
    engine: Engine,
    async_engine: AsyncEngine,
    box: SecretBox,
    clock: ManualClock,
    receiver: Receiver,
) -> None:
    add_endpoint(engine, box, receiver.route("/hook", status=400), "order.*")
    with engine.begin() as conn:
        publish(conn, "order.updated", {"v": 1}, subject="order/1")
        publish(conn, "order.updated", {"v": 1}, subject="order/2")
    await deliver(async_engine, box, clock)
    receiver.route("/hook", status=204)
    with engine.begin() as conn:
        newer = publish(conn, "order.updated", {"v": 2}, subject="order/1")
    await deliver(async_engine, box, clock)
    dead = scalar(engine, "SELECT min(id) FROM deliveries WHERE state = 'dead'")

    listed = cli.invoke(main, ["deliveries", "list", "--subject", "order/1", "--json"])
    assert listed.exit_code == 0, listed.output
    items = json.loads(listed.output)["items"]
    assert [(i["subject"], i["state"]) for i in items] == [
        ("order/1", "succeeded"),
        ("order/1", "dead"),
    ]
    hostile = cli.invoke(main, ["deliveries", "list", "--subject", "x" * 256])
    assert hostile.exit_code != 0 and "subject" in hostile.output

    refused = cli.invoke(main, ["replay", str(dead), "--reason", "fixed"])
    assert refused.exit_code == 1
    assert f"superseded: {dead} by {newer}" in refused.output and "--force" in refused.output
    dry = cli.invoke(main, ["replay", "--state", "dead", "--reason", "fixed", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "dry run: 1 delivery would be replayed; 1 superseded" in dry.output
    bulk = cli.invoke(main, ["replay", "--subject", "order/1", "--reason", "fixed"])
    assert "replayed 0 of 1 matching deliveries; 1 superseded" in bulk.output
    forced = cli.invoke(main, ["replay", str(dead), "--reason", "fixed", "--force"])
    assert forced.exit_code == 0, forced.output
    assert scalar(engine, "SELECT count(*) FROM deliveries WHERE replay_of = :d", d=dead) == 1
