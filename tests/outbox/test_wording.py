"""Counts read right ("1 attempt", "2 attempts") wherever they are shown."""

from __future__ import annotations

from delivery.operator.console.base import code_spans
from outbox.wording import plural


def test_plural_picks_the_noun_for_the_count() -> None:
    assert plural(1, "attempt") == "1 attempt"
    assert plural(0, "attempt") == "0 attempts"
    assert plural(2, "attempt") == "2 attempts"
    assert plural(1, "delivery", "deliveries") == "1 delivery"
    assert plural(3, "delivery", "deliveries") == "3 deliveries"
    assert plural(1.0, "second") == "1 second"
    assert plural(2.5, "second") == "2.5 seconds"


def test_backticks_become_code_and_everything_else_is_escaped() -> None:
    shown = code_spans("`outbox deliveries list --state dead` <b>shows</b> them")
    assert shown == "<code>outbox deliveries list --state dead</code> &lt;b&gt;shows&lt;/b&gt; them"
    assert code_spans("`<script>`") == "<code>&lt;script&gt;</code>"
    # An unpaired backtick is text, not the start of code that swallows the rest.
    assert code_spans("it's a ` stray") == "it&#39;s a ` stray"
