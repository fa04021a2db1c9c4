"""Every figure in the README's performance section comes from a `python -m bench` JSON file.

The section holds one block between `<!-- bench: docs/FILE.json -->` and
`<!-- /bench -->`, rendered by `python -m bench.readme docs/FILE.json`. This test
renders it again from the committed JSON and compares, and it refuses measured
figures (rates, latencies, sizes, shares) written by hand anywhere else in the
section, so the README cannot drift from the data again (issue 15, point 4).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.readme import BEGIN, END, render

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- bench: (?P<path>\S+) -->.*?<!-- /bench -->", re.DOTALL)
# A measured figure: a number with a unit of rate, time, size or share.
FIGURE = re.compile(r"\d[\d,.]*\s*(?:/s\b|req/s|ms\b|MB\b|%|\u00d7|x\b|rows/s)")


def performance_section(readme: str) -> str:
    start = readme.index("\n## Performance\n")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end >= 0 else len(readme)]


def test_the_figures_block_is_what_bench_readme_renders_from_its_json() -> None:
    section = performance_section((REPO / "README.md").read_text())
    blocks = list(BLOCK.finditer(section))
    assert len(blocks) == 1, "the performance section needs exactly one bench block"
    [block] = blocks
    path = block["path"]
    assert path.startswith("docs/") and path.endswith(".json"), path
    results = json.loads((REPO / path).read_text())
    assert block.group(0) == render(path, results), (
        f"the README's figures differ from {path}: paste `python -m bench.readme {path}`"
    )


def test_no_measured_figure_is_written_by_hand_outside_the_block() -> None:
    section = performance_section((REPO / "README.md").read_text())
    outside = BLOCK.sub("", section)
    outside = re.sub(r"```.*?```", "", outside, flags=re.DOTALL)  # commands
    found = FIGURE.findall(outside)
    assert not found, (
        f"figures outside the bench block: {found}; put them in a bench JSON and the block, "
        "or in docs/performance-history.md"
    )


def test_a_changed_figure_is_caught() -> None:
    """The comparison is exact: one digit off in the JSON changes the rendered block."""
    section = performance_section((REPO / "README.md").read_text())
    [block] = list(BLOCK.finditer(section))
    results = json.loads((REPO / block["path"]).read_text())
    results["rss"]["worker_peak_rss_mb"] += 1
    assert render(block["path"], results) != block.group(0)
    assert BEGIN.format(path=block["path"]) in block.group(0) and END in block.group(0)
    assert FIGURE.search("drained 2,400/s") and FIGURE.search("p99 12 ms")
