"""The performance page's figures, rendered from one `python -m bench` JSON file.

    python -m bench.readme bench/results/bench-results-DATE.json           # print the block
    python -m bench.readme bench/results/bench-results-DATE.json --write   # put it in the page
    python -m bench.readme bench/results/bench-results-DATE.json+bench/results/publish-DATE.json

A `+` joins supplements to the full run: files of `python -m bench --only SECTION` whose
sections the full run does not have (publish() per event, say), each shown with its own
file, duration and box load, so a figure measured alone still comes from a JSON file.
A supplement that is itself a full run (the run before, on the same code) adds its
ours / pgqueuer ratios to the verdicts: that target asks for two consecutive runs.

The docs site's performance page (docs/performance.md) holds the block between
`<!-- bench: FILE -->` and `<!-- /bench -->`; tests/project/test_readme_figures.py renders
it again from FILE and fails when the two differ, so a figure on that page cannot
drift from the JSON it came from.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from bench import scale
from bench.__main__ import _table, cost_report, drain_report, end_to_end_report, target_table
from bench.components import publish_report

BEGIN = "<!-- bench: {path} -->"
END = "<!-- /bench -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
BLOCK = re.compile(r"<!-- bench: (?P<path>\S+) -->.*?<!-- /bench -->", re.DOTALL)
USAGE = (
    "usage: python -m bench.readme bench/results/bench-results-DATE.json "
    "[+bench/results/SECTION-DATE.json] [--write]"
)


# Sections a supplement may add, each with the line that reports it.
SUPPLEMENTS = {"publish": publish_report}


def load(spec: str, root: Path = PAGE.parent.parent) -> dict[str, Any]:
    """The results of `spec` (a file, or a full run + supplements joined by `+`), with each
    supplement's sections and `supplements`: section -> (file, its whole results)."""
    main, *extra = spec.split("+")
    results: dict[str, Any] = json.loads((root / main).read_text())
    results["supplements"] = {}
    for path in extra:
        supplement = json.loads((root / path).read_text())
        if supplement.get("end_to_end") and supplement.get("ratios"):
            # Another full run (the one before, same code): its ours / pgqueuer ratios
            # join the verdicts, for the targets asked of two consecutive runs.
            results.setdefault("consecutive", []).append(
                {"file": path, "ratios": supplement["ratios"]}
            )
            continue
        for section in SUPPLEMENTS:
            if section in supplement and section not in results:
                results[section] = supplement[section]
                results["supplements"][section] = (path, supplement)
    return results


def _load_average(results: dict[str, Any]) -> str:
    load = results.get("load_average")
    if not load:
        return "load average not recorded"
    return f"1-minute load average {load['before'][0]:g} before, {load['after'][0]:g} after"


def render(path: str, results: dict[str, Any]) -> str:
    machine, pg = results["machine"], results.get("postgres", {})
    main = path.split("+")[0]
    lines = [
        BEGIN.format(path=path),
        f"From `{main}` (`python -m bench`, {results['total_seconds']:g} s; "
        f"{machine['cpus']} cores, Python {machine['python']}, "
        f"PostgreSQL {pg.get('server_version', '?')}):",
        "",
        target_table(results),
    ]
    if results.get("end_to_end"):
        lines += ["", *end_to_end_report(results)]
    if "drain" in results:
        lines += ["", *drain_report(results["drain"])]
    if cost_lines := cost_report(results):
        lines += ["", *cost_lines]
    if "scale" in results:
        lines += [
            "",
            "scale (issue 10, ratios within this run)",
            "",
            _table(scale.verdicts(results["scale"]), ["target", "measured", "goal", "verdict"]),
        ]
    for section, report in SUPPLEMENTS.items():
        if section not in results:
            continue
        source, whole = results.get("supplements", {}).get(section, (main, results))
        lines += [
            "",
            f"From `{source}` (`python -m bench --only {section}`, "
            f"{whole['total_seconds']:g} s; {_load_average(whole)}):"
            if source != main
            else f"From `{main}` ({_load_average(whole)}):",
            "",
            report(results[section]),
        ]
    lines.append(END)
    return "\n".join(lines)


def replace_block(page: str, block: str) -> str:
    """The page with its one bench block replaced; refuses a page without exactly one."""
    found = BLOCK.findall(page)
    if len(found) != 1:
        raise SystemExit(f"{PAGE} needs exactly one bench block, found {len(found)}")
    return BLOCK.sub(lambda _: block, page)


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] != "--write"):
        raise SystemExit(USAGE)
    path = argv[0]
    block = render(path, load(path, Path.cwd()))
    if len(argv) == 2:
        PAGE.write_text(replace_block(PAGE.read_text(), block))
        print(f"wrote the figures from {path} into {PAGE}")
    else:
        print(block)


if __name__ == "__main__":
    main(sys.argv[1:])
