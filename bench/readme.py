"""The README's performance figures, rendered from one `python -m bench` JSON file.

    python -m bench.readme docs/bench-results-DATE.json   # prints the block to paste

The README holds the block between `<!-- bench: FILE -->` and `<!-- /bench -->`;
tests/test_readme_figures.py renders it again from FILE and fails when the two
differ, so a figure in the README cannot drift from the JSON it came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench import scale
from bench.__main__ import _table, drain_report, end_to_end_report, target_table

BEGIN = "<!-- bench: {path} -->"
END = "<!-- /bench -->"


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
    if "scale" in results:
        lines += [
            "",
            "scale (issue 10, ratios within this run)",
            "",
            _table(scale.verdicts(results["scale"]), ["target", "measured", "goal", "verdict"]),
        ]
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.readme docs/bench-results-DATE.json")
    path = argv[0]
    print(render(path, json.loads(Path(path).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
