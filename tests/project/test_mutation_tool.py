"""The hand-written SQL mutants of tools/mutation.py still apply to today's code.

A mutant whose text is no longer found is reported "not applicable" and silently stops
testing its guard (three routing mutants went stale as the relay's statement changed:
operational events left out of `*`, then the statement split into fragments). Only
mutants written for the code before issue 15 may miss.
"""

from __future__ import annotations

from tests.helpers import ROOT
from tools.mutation import MODULES, SQL_MUTANTS, apply_mutant, failure_tail

OLD_FORMS = {"release (old): worker guard dropped"}


def test_every_sql_mutant_applies_to_the_working_tree() -> None:
    stale = [
        mutant.name
        for mutant in SQL_MUTANTS
        if mutant.name not in OLD_FORMS
        and apply_mutant((ROOT / mutant.file).read_text(), mutant) is None
    ]
    assert stale == []


def test_every_sql_mutant_changes_something() -> None:
    for mutant in SQL_MUTANTS:
        source = (ROOT / mutant.file).read_text()
        mutated = apply_mutant(source, mutant)
        if mutated is None:
            continue
        assert mutated != source, mutant.name


def test_every_test_file_a_subset_names_exists() -> None:
    named = {
        argument
        for arguments in [*MODULES.values(), *(m.tests for m in SQL_MUTANTS)]
        for argument in arguments
        if argument.startswith("tests/")
    }
    assert named
    assert sorted(p for p in named if not (ROOT / p.split("::")[0]).is_file()) == []


def test_a_run_that_proves_nothing_says_why() -> None:
    """mutmut 3 reports a failed clean run on stdout and exits 0, leaving every mutant
    'not checked': the report must carry what it said, not an empty tail."""
    said = "FAILED tests/test_x.py::test_y - clean run failed"
    tail = failure_tail(0, said, "", {"not checked": 12})
    assert said in tail and "clean test run failed" in tail
    assert failure_tail(1, "", "boom", {"killed": 3}) == "boom"
    assert failure_tail(0, said, "", {"killed": 3, "not checked": 1}) == ""
    assert failure_tail(0, "", "", {}) == ""
