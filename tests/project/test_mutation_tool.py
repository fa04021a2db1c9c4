"""The hand-written SQL mutants of tools/mutation.py still apply to today's code.

A mutant whose text is no longer found is reported "not applicable" and silently stops
testing its guard (three routing mutants went stale as the relay's statement changed:
operational events left out of `*`, then the statement split into fragments). Only
mutants written for the code before issue 15 may miss.

`--only` picks a module's functions by name: a selector that matched a neighbour's mutants
too would spend hours of a shared box, one that matched nothing would report a clean run.
"""

from __future__ import annotations

import pytest

from tests.helpers import ROOT
from tools.mutation import (
    MODULES,
    SQL_MUTANTS,
    SelectorError,
    _existing,
    _function_globs,
    apply_mutant,
    failure_tail,
    function_of,
    main,
    mutant_globs,
    no_match,
    selected,
)

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


# Names as mutmut 3 gives them (`ǁ` separates a class from its method).
NAMES = [
    "delivery.wire.connection.xǁWireResponseǁhead_received__mutmut_1",
    "delivery.wire.connection.xǁWireResponseǁhead_received__mutmut_17",
    "delivery.wire.connection.xǁWireResponseǁ__init____mutmut_3",
    "delivery.wire.connection.xǁ_Connectionǁ__init____mutmut_20",
    "delivery.wire.connection.xǁ_Poolǁacquire__mutmut_2",
    "delivery.wire.connection.xǁ_Poolǁtake_idle__mutmut_9",
    "delivery.wire.connection.x_head_received_late__mutmut_1",
    "delivery.wire.connection.x_head_received__mutmut_4",
]
CLAIMS = [
    "delivery.worker.claiming.xǁClaimingǁclaim__mutmut_1",
    "delivery.worker.claiming.xǁClaimingǁ_claim_round__mutmut_1",
    "delivery.worker.claiming.xǁClaimingǁ_prepare__mutmut_96",
]


def pick(module: str, names: list[str], *selectors: str) -> list[str]:
    globs = mutant_globs(module, selectors)
    return [name for name in names if selected(name, globs)]


def test_only_selects_the_named_functions_mutants_and_no_neighbours() -> None:
    wire = "delivery/wire/connection.py"
    # A bare name: the module function and any class's method of that name, not a longer one.
    assert pick(wire, NAMES, "head_received") == [NAMES[0], NAMES[1], NAMES[7]]
    assert pick(wire, NAMES, "WireResponse.head_received") == NAMES[:2]
    # `__init__` is a method like any other: one class's, not the other's.
    assert pick(wire, NAMES, "_Connection.__init__") == [NAMES[3]]
    assert pick(wire, NAMES, "_Pool.*") == NAMES[4:6]
    assert pick(wire, NAMES, "_Pool.acquire", "_Connection.__init__") == [NAMES[3], NAMES[4]]
    # A glob of mutmut's own names is taken as it is.
    assert pick(wire, NAMES, "*head_received__mutmut_1?") == [NAMES[1]]
    claiming = "delivery/worker/claiming.py"
    assert pick(claiming, CLAIMS, "Claiming.claim") == CLAIMS[:1]
    assert pick(claiming, CLAIMS, "claim") == CLAIMS[:1]
    assert pick(claiming, CLAIMS, "Claiming._claim_round", "_prepare") == CLAIMS[1:]
    # Another module's function of the same name is not this module's.
    assert pick("delivery/wire/connect.py", NAMES, "head_received") == []


def test_the_clean_runs_globs_name_the_functions_and_no_mutant() -> None:
    """mutmut matches its run arguments against function names to choose the clean run's
    tests; these must match the selected functions' names and add no mutant."""
    globs = mutant_globs("delivery/worker/claiming.py", ["Claiming.claim", "_prepare"])
    functions = _function_globs(globs)
    assert all("*" in glob for glob in functions)  # mutmut looks up names without one
    assert selected("delivery.worker.claiming.xǁClaimingǁclaim", functions)
    assert selected("delivery.worker.claiming.xǁClaimingǁ_prepare", functions)
    assert not selected("delivery.worker.claiming.xǁClaimingǁ_claim_round", functions)
    assert [name for name in CLAIMS if selected(name, functions)] == []


def test_the_function_a_mutant_is_in() -> None:
    assert function_of(NAMES[0]) == "WireResponse.head_received"
    assert function_of(NAMES[3]) == "_Connection.__init__"
    assert function_of(NAMES[7]) == "head_received"


@pytest.mark.parametrize("selector", ["", "a.b.c", "Claiming.", "two words", "Claiming .claim"])
def test_a_selector_that_names_no_function_is_refused_with_the_forms_it_takes(
    selector: str,
) -> None:
    with pytest.raises(SelectorError, match="name a function"):
        mutant_globs("delivery/worker/claiming.py", [selector])


def test_only_needs_exactly_one_module_and_a_valid_selector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["--only", "claim"],
        ["delivery/worker/claiming.py", "delivery/wire/connect.py", "--only", "claim"],
        ["delivery/worker/claiming.py", "--only", "a.b.c"],
        ["--tests", "tests/delivery/test_claiming.py"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "--only selects functions of one module" in said
    assert "'a.b.c': name a function" in said
    assert "--tests replaces one module's subset" in said


def test_a_narrower_subset_may_name_single_tests() -> None:
    """`--tests file::test` keeps the test when its file exists (an older revision without
    the file drops it, as it drops a missing file)."""
    named = "tests/delivery/test_claiming.py::test_a_second_round_fills_the_batch"
    kept = _existing(ROOT, [named, "tests/delivery/nothing.py::test_x", "-k", "not slow"])
    assert kept == [named, "-k", "not slow"]


def test_a_selection_that_matched_nothing_names_the_functions_there_are() -> None:
    said = no_match("delivery/worker/claiming.py", ["clam"], {"Claiming.claim", "_prepare"})
    assert "no mutant of delivery/worker/claiming.py matches --only clam" in said
    assert "Claiming.claim, _prepare" in said


def test_without_mutmut_the_command_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a run of 0 mutants that exits 0: that proved nothing and looked clean."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mutmut" else real(name, *a)
    )
    with pytest.raises(SystemExit) as exited:
        main(["outbox/direct.py", "--no-sql"])
    assert exited.value.code == 2
    assert "mutmut is not installed: pip install -e '.[mutation]'" in capsys.readouterr().err
