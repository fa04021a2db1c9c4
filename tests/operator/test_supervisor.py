"""`outbox run --processes N`: stateless processes that share only the database."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

from delivery.operator.supervisor import ProcessSpec, Supervisor, child_spec
from delivery.reaper import ReaperConfig
from delivery.receiver import Receiver
from delivery.worker import WorkerConfig
from outbox import publish
from outbox.crypto import SecretBox, generate_key
from outbox.relay import RelayConfig
from tests.helpers import ROOT, add_endpoint, rows, scalar, until


def children(pid: int) -> set[int]:
    """The service processes the supervisor spawned (not multiprocessing's resource tracker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    found = set()
    for child in path.read_text().split() if path.exists() else []:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"spawn_main" in cmdline and state != "Z":
            found.add(int(child))
    return found


def _in_mask(pid: int, field: str, signum: int) -> bool:
    """Whether `signum` is in process `pid`'s signal mask `field` (SigBlk, SigIgn, ShdPnd
    in /proc/PID/status); False once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_each_child_gets_its_own_worker_id() -> None:
    spec = ProcessSpec(
        url="postgresql://x/y",
        secret_keys="k:AAAA",
        relay=RelayConfig(),
        worker=WorkerConfig(worker_id="host:abc"),
        reaper=ReaperConfig(),
    )
    assert child_spec(spec, 0).worker.worker_id == "host:abc.0"
    assert child_spec(spec, 1).worker.worker_id == "host:abc.1"
    assert child_spec(spec, 1).relay == spec.relay


@pytest.mark.slow  # real child processes
async def test_two_processes_deliver_everything_restart_a_killed_child_and_stop_cleanly(
    engine: Engine, database_url: str, receiver: Receiver
) -> None:
    key = generate_key("test")
    box = SecretBox.from_setting(key)
    add_endpoint(engine, box, receiver.route("/hook"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_SECRET_KEYS": key,
        "OUTBOX_WORKER_POLL_INTERVAL": "0.2",
        "OUTBOX_RELAY_POLL_INTERVAL": "0.2",
        "OUTBOX_ALLOWED_NETWORKS": "127.0.0.0/8",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from delivery.operator.cli import main; main()",
        "run",
        "--processes",
        "2",
        cwd=ROOT,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await until(lambda: len(children(process.pid)) >= 2, "two children", seconds=30)
        first = children(process.pid)
        with engine.begin() as conn:
            for number in range(40):
                publish(conn, "order.created", {"n": number})
        await until(lambda: len(receiver.received("/hook")) >= 40, "40 delivered", seconds=30)

        # A child that dies is replaced; the work keeps flowing.
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        await until(
            lambda: victim not in children(process.pid) and len(children(process.pid)) >= 2,
            "the killed child replaced",
            seconds=30,
        )
        with engine.begin() as conn:
            for number in range(40, 60):
                publish(conn, "order.created", {"n": number})
        await until(lambda: len(receiver.received("/hook")) >= 60, "60 delivered", seconds=30)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=40)
    assert process.returncode == 0, stderr.decode()
    assert "running 2 processes" in stderr.decode()
    received_ids = {r.headers["webhook-id"] for r in receiver.received("/hook")}
    assert len(received_ids) == 60
    # The killed child may have sent requests whose outcome it never wrote: those stay
    # leased to it until the reaper rescues them (and they go out again, same webhook-id).
    states = rows(engine, "SELECT state, locked_by FROM deliveries WHERE state <> 'succeeded'")
    assert {(row.state, row.locked_by) for row in states} <= {
        ("in_flight", worker) for worker in {row.locked_by for row in states}
    }
    assert len({row.locked_by for row in states}) <= 1
    workers = scalar(engine, "SELECT array_agg(DISTINCT worker_id) FROM delivery_attempts")
    assert all(w.rsplit(".", 1)[1] in {"0", "1"} for w in workers)


def test_a_stop_while_the_children_start_stops_them_all(database_url: str) -> None:
    """Ctrl-C right after "outbox running" lands while the children are being spawned:
    no child starts after it, and none is left running until the grace kills it."""

    class StoppedWhileStarting(Supervisor):
        def _start(self, index: int) -> None:
            super()._start(index)
            if index == 0:
                self.stop()  # what the SIGINT handler does, between two starts

    spec = ProcessSpec(
        url=database_url,
        secret_keys=generate_key("supervisor"),
        relay=RelayConfig(),
        worker=WorkerConfig(),
        reaper=ReaperConfig(),
    )
    supervisor = StoppedWhileStarting(spec, 3)
    started = time.monotonic()
    assert supervisor.run(grace=20) == 0
    assert time.monotonic() - started < 15
    assert len(supervisor._children) == 1
    assert not any(child.is_alive() for child in supervisor._children.values())


def test_a_ctrl_c_while_a_child_is_still_starting_does_not_kill_it(database_url: str) -> None:
    """A terminal's Ctrl-C reaches the whole process group, a child still importing too:
    the child starts with SIGINT ignored (the supervisor relays the stop), so it neither
    dies with a KeyboardInterrupt traceback nor stops; SIGTERM then stops it cleanly."""
    spec = ProcessSpec(
        url=database_url,
        secret_keys=generate_key("supervisor"),
        relay=RelayConfig(),
        worker=WorkerConfig(),
        reaper=ReaperConfig(),
    )
    supervisor = Supervisor(spec, 1)
    supervisor._start(0)
    child = supervisor._children[0]
    assert child.pid is not None
    os.kill(child.pid, signal.SIGINT)  # at once: the spawned interpreter is importing
    # Wait for the Ctrl-C itself, not a fixed time: while SIGINT is blocked it is held
    # pending; once it is neither, it has been acted on, and it must have been ignored.
    deadline = time.monotonic() + 60
    while child.is_alive() and (
        _in_mask(child.pid, "SigBlk", signal.SIGINT) or _in_mask(child.pid, "ShdPnd", signal.SIGINT)
    ):
        assert time.monotonic() < deadline, "the child held the Ctrl-C pending for a minute"
        time.sleep(0.02)
    assert _in_mask(child.pid, "SigIgn", signal.SIGINT), (
        f"the child does not ignore the Ctrl-C (exit code {child.exitcode})"
    )
    assert child.is_alive()
    os.kill(child.pid, signal.SIGTERM)
    child.join(30)
    # Not -SIGINT (nor 1, a KeyboardInterrupt): it died of the SIGTERM, or stopped on it.
    assert child.exitcode in (0, -signal.SIGTERM)
