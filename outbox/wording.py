"""Words for people: counts with the right plural ("1 attempt", "2 attempts").

Shared by the CLI, the alert messages and the console, so every view says it the same way.
"""

from __future__ import annotations


def plural(count: float, singular: str, plural_form: str | None = None) -> str:
    """`count` and the noun in the number it needs; irregular plurals are given."""
    noun = singular if count == 1 else (plural_form or singular + "s")
    shown = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{shown} {noun}"
