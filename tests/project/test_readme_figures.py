"""Every figure on the performance page comes from a `python -m bench` JSON file.

The page (docs/performance.md, the README's performance section until issue 27) holds
one block between `<!-- bench: bench/results/FILE.json -->` and `<!-- /bench -->`,
rendered by `python -m bench.readme bench/results/FILE.json --write`. This test renders
it again from the committed JSON and compares, and it refuses measured figures (rates,
latencies, sizes, shares) written by hand anywhere else on the page, so the page cannot
drift from the data again (issue 15, point 4). The README itself carries no figures.
"""

from __future__ import annotations

import json
import re

from bench.readme import BEGIN, END, PAGE, render, replace_block
from tests.helpers import ROOT

BLOCK = re.compile(r"<!-- bench: (?P<path>\S+) -->.*?<!-- /bench -->", re.DOTALL)
# A measured figure: a number with a unit of rate, time, size or share.
FIGURE = re.compile(r"\d[\d,.]*\s*(?:/s\b|req/s|ms\b|MB\b|%|\u00d7|x\b|rows/s)")


def performance_section() -> str:
    """The whole performance page: every part of it is "current figures"."""
    assert PAGE == ROOT / "docs" / "performance.md"
    return PAGE.read_text()


def test_the_figures_block_is_what_bench_readme_renders_from_its_json() -> None:
    section = performance_section()
    blocks = list(BLOCK.finditer(section))
    assert len(blocks) == 1, "the performance section needs exactly one bench block"
    [block] = blocks
    path = block["path"]
    assert path.startswith("bench/results/") and path.endswith(".json"), path
    results = json.loads((ROOT / path).read_text())
    assert block.group(0) == render(path, results), (
        f"the performance page's figures differ from {path}: "
        f"run `python -m bench.readme {path} --write`"
    )


def test_no_measured_figure_is_written_by_hand_outside_the_block() -> None:
    section = performance_section()
    outside = BLOCK.sub("", section)
    outside = re.sub(r"```.*?```", "", outside, flags=re.DOTALL)  # commands
    found = FIGURE.findall(outside)
    assert not found, (
        f"figures outside the bench block: {found}; put them in a bench JSON and the block, "
        "or in docs/performance-history.md"
    )


def test_a_changed_figure_is_caught() -> None:
    """The comparison is exact: one digit off in the JSON changes the rendered block."""
    section = performance_section()
    [block] = list(BLOCK.finditer(section))
    results = json.loads((ROOT / block["path"]).read_text())
    results["rss"]["worker_peak_rss_mb"] += 1
    assert render(block["path"], results) != block.group(0)
    assert BEGIN.format(path=block["path"]) in block.group(0) and END in block.group(0)
    assert FIGURE.search("drained 2,400/s") and FIGURE.search("p99 12 ms")


def test_the_readme_carries_no_figures_and_writing_replaces_only_the_block() -> None:
    """Figures live on the performance page alone; `--write` keeps the text around them."""
    readme = (ROOT / "README.md").read_text()
    assert BLOCK.search(readme) is None and not FIGURE.findall(readme)
    section = performance_section()
    [block] = list(BLOCK.finditer(section))
    results = json.loads((ROOT / block["path"]).read_text())
    results["rss"]["worker_peak_rss_mb"] += 1
    changed = replace_block(section, render(block["path"], results))
    assert changed != section
    assert BLOCK.sub("", changed) == BLOCK.sub("", section)
