"""The documentation site builds with `mkdocs build --strict`: a broken link or anchor, a
page left out of the nav or a missing snippet fails the suite (issue 27). The API
reference and the code map it generates cover every route and every module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from delivery.operator.api import openapi_document
from tests.helpers import ROOT

# Each test builds the whole documentation site with mkdocs.
pytestmark = pytest.mark.slow


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # Not --quiet: it raises the log level past WARNING, and --strict counts warnings,
    # so a quiet strict build passes with broken links (this file's second test saw it).
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_of_the_site_sources(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    (project / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "docs_site.py", project / "tools")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, project)
    return project


def test_the_site_builds_strict_with_every_route_and_module(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = mkdocs_build(ROOT, site)
    assert built.returncode == 0, built.stdout + built.stderr

    document = openapi_document()
    assert json.loads((site / "reference" / "openapi.json").read_text()) == document
    reference = (site / "reference" / "api" / "index.html").read_text()
    for path, item in document["paths"].items():
        for method in item:
            assert f"{method.upper()} {path}" in reference, (method, path)

    architecture = (site / "architecture" / "index.html").read_text()
    for package in ("outbox", "delivery", "bench", "tools"):
        for module in (ROOT / package).rglob("*.py"):
            assert str(module.relative_to(ROOT)) in architecture, module
    assert "<!-- bench: bench/results/" in (ROOT / "docs" / "performance.md").read_text()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """One build of a copy with three faults: each is named, and nothing else is (so the
    copy itself builds clean, and the build fails for these three only)."""
    project = copy_of_the_site_sources(tmp_path)
    page = project / "docs" / "security.md"
    page.write_text(
        page.read_text()
        + "\nSee [nowhere](no-such-page.md).\n"
        + "\nSee [a missing anchor](settings.md#no-such-heading).\n"
    )
    (project / "docs" / "orphan.md").write_text("# Not in the nav\n")
    broken = mkdocs_build(project, tmp_path / "broken")
    output = broken.stdout + broken.stderr
    assert broken.returncode != 0, output
    for fault in ("no-such-page.md", "no-such-heading", "orphan.md"):
        assert fault in output, (fault, output)
    assert "Aborted with 3 warnings in strict mode" in output, output
