"""The previous release's code, for running it beside this one (docs/operating.md, "Upgrading").

PREVIOUS_RELEASE names its commit. `checkout()` extracts that commit's files (`git
archive`, so the repository's history is needed, not a shallow clone) into a
directory; a process started there with `env()` imports the old `outbox` and
`delivery` packages instead of this checkout's (the working directory and
PYTHONPATH come before the editable install on sys.path), with this virtualenv's
dependencies. Used by tests/project/test_upgrade.py and bench/migration_stall.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `outbox ...` of whichever release the working directory holds.
OUTBOX = [sys.executable, "-c", "from delivery.operator.cli import main; main()"]


class PreviousReleaseError(RuntimeError):
    """The previous release's files cannot be had (no git, or no history)."""


def commit() -> str:
    lines = (ROOT / "PREVIOUS_RELEASE").read_text().splitlines()
    return next(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def checkout(target: Path) -> Path:
    """The previous release's files under `target` (which must exist and be empty)."""
    wanted = commit()
    archive = subprocess.run(
        # safe.directory: a CI checkout may belong to another user than the tests' one.
        ["git", "-c", "safe.directory=*", "-C", str(ROOT), "archive", wanted],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise PreviousReleaseError(
            f"cannot read the previous release {wanted} from git "
            f"({archive.stderr.decode().strip()!r}): this needs the repository's history "
            "(a full clone, not --depth 1)"
        )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def env(release: Path, base: dict[str, str]) -> dict[str, str]:
    """`base` for a process of `release` (this checkout, or a previous release's files)."""
    found = dict(base)
    if release.resolve() != ROOT:
        found["PYTHONPATH"] = str(release)
    else:
        found.pop("PYTHONPATH", None)
    return found


def base_env(**settings: str) -> dict[str, str]:
    """This process's environment without any OUTBOX_ setting, plus `settings`."""
    found = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    found.update(settings)
    return found
