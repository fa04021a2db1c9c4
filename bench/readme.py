"""The performance page's figures, rendered from one `python -m bench` JSON file.

    python -m bench.readme bench/results/bench-results-DATE.json           # print the block
    python -m bench.readme bench/results/bench-results-DATE.json --write   # put it in the page

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

BEGIN = "<!-- bench: {path} -->"
END = "<!-- /bench -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
BLOCK = re.compile(r"<!-- bench: (?P<path>\S+) -->.*?<!-- /bench -->", re.DOTALL)
USAGE = "usage: python -m bench.readme bench/results/bench-results-DATE.json [--write]"


def render(path: str, results: dict[str, Any]) -> str:
    machine, pg = results["machine"], results.get("postgres", {})
    lines = [
        BEGIN.format(path=path),
        f"From `{path}` (`python -m bench`, {results['total_seconds']:g} s; "
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
    block = render(path, json.loads(Path(path).read_text()))
    if len(argv) == 2:
        PAGE.write_text(replace_block(PAGE.read_text(), block))
        print(f"wrote the figures from {path} into {PAGE}")
    else:
        print(block)


if __name__ == "__main__":
    main(sys.argv[1:])
