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
from pathlib import Path

from bench.readme import BEGIN, END, PAGE, load, render, replace_block
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
    for part in path.split("+"):  # the full run, then any supplements
        assert part.startswith("bench/results/") and part.endswith(".json"), part
    results = load(path, ROOT)
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
    results = load(block["path"], ROOT)
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
    results = load(block["path"], ROOT)
    results["rss"]["worker_peak_rss_mb"] += 1
    changed = replace_block(section, render(block["path"], results))
    assert changed != section
    assert BLOCK.sub("", changed) == BLOCK.sub("", section)


def test_a_supplement_is_rendered_from_its_own_file_with_its_box_load(tmp_path: Path) -> None:
    """A section measured alone (`python -m bench --only publish`) joins the block with `+`:
    its figures, its file, its duration and how busy the box was, all from that file."""
    [block] = list(BLOCK.finditer(performance_section()))
    main = block["path"].split("+")[0]
    (tmp_path / "bench" / "results").mkdir(parents=True)
    # a full run without the section (a full run that has it keeps its own)
    whole = json.loads((ROOT / main).read_text())
    whole.pop("publish", None)
    (tmp_path / main).write_text(json.dumps(whole))
    variants = {"no key": 400.0, "new key": 420.5, "same key again": 390.0}
    row = {"payload_bytes": 60, "us_per_event": variants, "hash_alone_us": 1.5}
    supplement = {
        "publish": {"events": 2000, "rounds": 3, "per_transaction": 100, "small": row,
                    "large": {**row, "payload_bytes": 14919}},
        "total_seconds": 42.0,
        "load_average": {"before": [3.5, 2, 1], "after": [4.25, 2, 1]},
    }  # fmt: skip
    (tmp_path / "bench/results/publish-x.json").write_text(json.dumps(supplement))
    spec = f"{main}+bench/results/publish-x.json"
    rendered = render(spec, load(spec, tmp_path))
    assert rendered.startswith(BEGIN.format(path=spec)) and rendered.endswith(END)
    assert (
        "From `bench/results/publish-x.json` (`python -m bench --only publish`, 42 s; "
        "1-minute load average 3.5 before, 4.25 after):"
    ) in rendered
    assert "60 B payload: no key 400, new key 420.5, same key again 390 (hash alone 1.5)" in (
        rendered
    )
    supplement["publish"]["small"]["hash_alone_us"] = 1.6  # type: ignore[index]
    (tmp_path / "bench/results/publish-x.json").write_text(json.dumps(supplement))
    assert render(spec, load(spec, tmp_path)) != rendered


def test_a_second_full_run_adds_its_peer_ratios_to_the_verdicts(tmp_path: Path) -> None:
    """Issue 26 asks for ours / pgqueuer in two consecutive runs: a full run joined with
    `+` puts its ratios in the target table, each with its file and its own verdict."""
    [block] = list(BLOCK.finditer(performance_section()))
    main = block["path"].split("+")[0]
    (tmp_path / "bench" / "results").mkdir(parents=True)
    whole = json.loads((ROOT / main).read_text())
    (tmp_path / main).write_text(json.dumps(whole))
    other = {**whole, "ratios": {"fanout_1": 2.25, "fanout_10": 1.5}}
    (tmp_path / "bench/results/run-before.json").write_text(json.dumps(other))
    spec = f"{main}+bench/results/run-before.json"
    rendered = render(spec, load(spec, tmp_path))
    row = re.compile(r"\| ours / pgqueuer, (fanout \d+) \(bench/results/run-before\.json\) +\| "
                     r"(\S+) +\| >= 2 +\| (.+?) +\|")  # fmt: skip
    assert {m[1]: (m[2], m[3]) for m in row.finditer(rendered)} == {
        "fanout 1": ("2.25", "met"),
        "fanout 10": ("1.5", "missed by 25%"),
    }
    # the run's own ratios are still there, once each
    assert rendered.count("| ours / pgqueuer, fanout 10 ") == 2
