"""RE2 against a nested-quantifier check on Python's `re` (issue 29): which hostile patterns
each stops, and what a match costs. `python -m tools.regex_engines` prints the table that
docs/schema-rules.md quotes."""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Callable
from typing import Any

import re2

# Python's own regex parser (private modules, so no stubs): the check walks its tree.
sre_parse: Any = importlib.import_module("re._parser")
sre_constants: Any = importlib.import_module("re._constants")

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


def nested_quantifier(pattern: str) -> bool:
    """True when a repeated group holds another unbounded repeat: the usual ReDoS check."""

    def walk(items: Any, inside_repeat: bool) -> bool:
        for op, arg in items:
            if op in _REPEATS:
                _, high, body = arg
                unbounded = high == sre_constants.MAXREPEAT or high > 1
                if inside_repeat and unbounded:
                    return True
                if walk(body, inside_repeat or unbounded):
                    return True
            elif (op == sre_constants.SUBPATTERN and walk(arg[-1], inside_repeat)) or (
                op == sre_constants.BRANCH and any(walk(b, inside_repeat) for b in arg[1])
            ):
                return True
        return False

    return walk(sre_parse.parse(pattern), False)


def _seconds(run: Callable[[], object], limit: float = 5.0) -> float:
    started = time.perf_counter()
    run()
    return min(time.perf_counter() - started, limit)


def main() -> None:
    hostile = ["^(a+)+$", "^(a|a)*$", "^(a|aa)+$", "^(\\w+\\s?)*$", "^(\\d+)*$"]
    print(
        "pattern | nested-quantifier check | re, 'a'*22+'!' | re2, 'a'*22+'!' | re2, 'a'*10000+'!'"
    )
    for pattern in hostile:
        text = "a" * 22 + "!"
        if pattern == "^(\\d+)*$":
            text = "1" * 22 + "!"
        slow = re.compile(pattern)
        fast = re2.compile(pattern)
        print(
            f"{pattern} | {'refused' if nested_quantifier(pattern) else 'MISSED'} | "
            f"{_seconds(lambda: slow.search(text)) * 1000:.1f} ms | "  # noqa: B023
            f"{_seconds(lambda: fast.search(text)) * 1e6:.1f} us | "  # noqa: B023
            f"{_seconds(lambda: fast.search(text[0] * 10000 + '!')) * 1000:.2f} ms"  # noqa: B023
        )
    ordinary = re.compile(r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$")
    ordinary2 = re2.compile(r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$")
    email = "someone.name+tag@example.co.uk"
    rounds = 100_000
    re_us = _seconds(lambda: [ordinary.search(email) for _ in range(rounds)], 60) / rounds * 1e6
    re2_us = _seconds(lambda: [ordinary2.search(email) for _ in range(rounds)], 60) / rounds * 1e6
    print(f"ordinary e-mail pattern, one search: re {re_us:.2f} us, re2 {re2_us:.2f} us")


if __name__ == "__main__":
    main()
