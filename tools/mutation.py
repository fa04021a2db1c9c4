"""Mutation testing of the modules where a wrong line loses or corrupts data or security.

    python -m tools.mutation                       # every module below, this checkout
    python -m tools.mutation delivery/ssrf.py      # one module (or several)
    python -m tools.mutation --rev main --out /tmp/before.json   # another git revision
    python -m tools.mutation delivery/wire/connection.py --no-sql \
        --only WireResponse.head_received --only '_Pool.*'     # some functions only

Two kinds of mutant, each judged by the fastest test subset that covers the module:

* Python modules go through mutmut (installed by the `mutation` extra): it flips
  operators, constants, conditions and arguments, and runs, for each mutant, only
  the tests of the subset that call the mutated function.
* SQL guards are plain strings to mutmut (it can only turn a whole statement into
  'XX...XX', which proves nothing about the guard). SQL_MUTANTS (tools/sql_mutants.py)
  removes or weakens one guard condition at a time; each mutant runs its own tests.

Everything happens in a scratch copy (`git archive` of the revision, or of the
working tree's files), so the checkout is never modified. One PostgreSQL server is
started for the whole run (OUTBOX_TEST_DATABASE_URL) instead of one per mutant.
The result is JSON: per module, mutants, killed, survivors (with each survivor's
diff). docs/mutation.md records the runs and explains the survivors. Slow: a full
run takes tens of minutes on a free machine; it is not part of the test suite.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.sql_mutants import OLD_OQ, ROOT, SQL_MUTANTS, apply_mutant

# The wire against scripted loopback receivers and a real proxy; test_proxy's
# settings, CLI, API and `outbox run` tests are left out (they add no wire line).
_WIRE_TESTS = [
    "tests/delivery/test_wire.py",
    "tests/delivery/test_wire_defects.py",
    "tests/delivery/test_wire_edges.py",
    "tests/delivery/test_wire_fuzz.py",
    "tests/delivery/test_wire_shortcuts.py",  # read_capped against aiter_raw, the poller
    "tests/delivery/test_connect_race.py",
    "tests/delivery/test_proxy.py",
    "-k",
    "not (in_every_process or test_cli_sets or admin_api_sets or key_rotation_re_encrypts"
    " or hostile_proxy_urls or the_setting_is_validated)",
]

# Claims, leases, outcome recording and the loop; the transport is not what it decides.
_WORKER_TESTS = [
    "tests/delivery/test_fencing.py",
    "tests/delivery/test_rules.py",
    "tests/delivery/test_worker.py",
    "tests/delivery/test_documented_rules.py",
    "tests/delivery/test_handoff.py",
    "tests/delivery/test_claim_on_completion.py",
    "tests/delivery/test_claiming.py",
    "tests/delivery/test_worker_outcomes.py",
    "-k",
    "not httpx",
]

# Claims also decide which path finds the batch (the worker's `gate_paths`, pinned there).
_CLAIM_TESTS = [
    *_WORKER_TESTS[:-2],
    "tests/delivery/test_claim_rank.py::"
    "test_the_worker_tries_the_quick_path_while_a_batch_of_tenants_have_work",
    *_WORKER_TESTS[-2:],
]

# Module -> the fastest tests that pin its behaviour. Parametrized transports run on
# httpx only here: the transport is not what these modules decide.
MODULES: dict[str, list[str]] = {
    "delivery/policy.py": [
        "tests/delivery/test_policy.py",
        "tests/delivery/test_documented_rules.py",
        "-k",
        "not aiohttp",
    ],
    "outbox/endpoint_rules.py": [
        "tests/outbox/test_rules_config.py",
        "tests/outbox/test_tenant_scope.py",
    ],
    "delivery/signing.py": [
        "tests/delivery/test_verify.py",
        "tests/delivery/test_ed25519.py",  # the v1a branch
        "tests/delivery/test_worker.py",
        "-k",
        "not aiohttp",
    ],
    "delivery/verify.py": ["tests/delivery/test_verify.py"],
    "delivery/ssrf.py": ["tests/delivery/test_ssrf.py"],
    "delivery/reaper.py": [
        "tests/delivery/test_fencing.py",
        "tests/delivery/test_reaper.py",
        "-k",
        "not aiohttp",
    ],
    "outbox/relay.py": [
        "tests/outbox/test_relay.py",
        "tests/outbox/test_tenant_routing.py",
        "tests/delivery/test_handoff.py",
    ],
    # The outcome of one attempt, against real loopback receivers (both transports).
    "delivery/http.py": [
        "tests/delivery/test_transport.py",
        "tests/delivery/test_documented_rules.py",
        "tests/delivery/test_bounded_requests.py",
        "tests/delivery/test_proxy.py",
        "tests/delivery/test_http_outcomes.py",
        "-k",
        # uvloop's handles warn when collected under mutmut's stats run (warnings are errors)
        "not in_every_process and not uvloop",
    ],
    # The claim, the outcome record and the relay's pass on psycopg directly: the
    # differential tests against SQLAlchemy's own execution, then the worker tests that
    # run through it.
    "outbox/direct.py": [
        "tests/delivery/test_direct.py",
        "tests/outbox/test_relay_direct.py",
        "tests/delivery/test_claiming.py",
        "tests/delivery/test_worker_outcomes.py",
        "tests/delivery/test_fencing.py",
    ],
    "delivery/worker/model.py": _WORKER_TESTS,
    "delivery/worker/claiming.py": _CLAIM_TESTS,
    "delivery/worker/outcomes.py": _WORKER_TESTS,
    "delivery/worker/loop.py": _WORKER_TESTS,
    "outbox/deliveries.py": [
        "tests/outbox/test_deliveries.py",
        "tests/outbox/test_deliveries_replay.py",
        "tests/outbox/test_deliveries_views.py",
        # Each write's own tenant scope (the lookup before it made unscoped on purpose).
        "tests/outbox/test_tenant_scope.py",
    ],
    "outbox/endpoints.py": [
        "tests/outbox/test_endpoints_audit.py",
        "tests/outbox/test_deliveries.py",
        "tests/outbox/test_tenant_scope.py",
    ],
    "delivery/wire/connection.py": _WIRE_TESTS,
    "delivery/wire/connect.py": _WIRE_TESTS,
    "delivery/wire/transport.py": _WIRE_TESTS,
}


# mutmut names a mutant `<module>.x_<function>__mutmut_<n>` (a module function) or
# `<module>.xǁ<Class>ǁ<method>__mutmut_<n>` (a method); `mutmut run` takes fnmatch globs
# of those names.
_CLASS_MARK = "\u01c1"  # ǁ
_MUTANT_SUFFIX = "__mutmut_"


class SelectorError(ValueError):
    """An `--only` selector that names no function the way mutmut's names can match."""


def mutant_globs(module: str, selectors: Sequence[str]) -> list[str]:
    """mutmut's globs for `--only`: each selector is a function or method name (`claim`,
    also any class's method of that name), a method (`Claiming.claim`), either with
    fnmatch wildcards (`_Pool.*`), or a glob of mutmut's own names (one containing
    `__mutmut_`, e.g. `delivery.wire.connection.x*head_received__mutmut_1?`)."""
    dotted = module.removesuffix(".py").replace("/", ".")
    globs: list[str] = []
    for selector in selectors:
        if _MUTANT_SUFFIX in selector:
            globs.append(selector)
            continue
        owner, _, function = selector.rpartition(".")
        if not function or "." in owner or any(c.isspace() for c in selector):
            raise SelectorError(
                f"--only {selector!r}: name a function (`head_received`), a method"
                " (`WireResponse.head_received`), wildcards allowed (`_Pool.*`), or give a"
                " glob of mutmut's mutant names (containing `__mutmut_`)"
            )
        if owner:
            globs.append(f"{dotted}.x{_CLASS_MARK}{owner}{_CLASS_MARK}{function}{_MUTANT_SUFFIX}*")
        else:
            globs.append(f"{dotted}.x_{function}{_MUTANT_SUFFIX}*")
            globs.append(f"{dotted}.x{_CLASS_MARK}*{_CLASS_MARK}{function}{_MUTANT_SUFFIX}*")
    return globs


def _function_globs(globs: Sequence[str]) -> list[str]:
    """The same selection as mutmut's names of the functions themselves. mutmut picks the
    clean run's tests by matching its run arguments against function names (no
    `__mutmut_` suffix, and only arguments with a `*` are matched, not looked up): without
    these, the clean run takes the module's whole subset. They match no mutant."""
    out = []
    for glob in globs:
        if glob.endswith(_MUTANT_SUFFIX + "*"):
            module, dot, function = glob.removesuffix(_MUTANT_SUFFIX + "*").partition(".x")
            out.append(f"{module}*{dot}{function}")
    return out


def selected(name: str, globs: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)


def function_of(mutant: str) -> str:
    """`Claiming.claim` or `head_received`: the function a mutmut mutant name is in."""
    mangled = mutant.partition(_MUTANT_SUFFIX)[0].rpartition(".")[2]
    if mangled.startswith("x" + _CLASS_MARK):
        return ".".join(mangled[2:].split(_CLASS_MARK))
    return mangled.removeprefix("x_")


def _export(rev: str | None, into: Path) -> None:
    """The revision's tracked files (or the working tree's) into a scratch folder."""
    if rev:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def _existing(copy: Path, selection: list[str] | tuple[str, ...]) -> list[str]:
    """Drop test files the revision does not have (an older revision lacks newer tests)."""
    out: list[str] = []
    skip_next = False
    for item in selection:
        if skip_next:
            skip_next = False
            out.append(item)
            continue
        if item == "-k":
            skip_next = True
            out.append(item)
        elif item.startswith("tests/") and not (copy / item.split("::")[0]).exists():
            continue
        else:
            out.append(item)
    return out


def _mutmut_module(
    copy: Path,
    module: str,
    selection: list[str],
    only: Sequence[str] = (),
    max_children: int | None = None,
) -> dict[str, Any]:
    if not any(item.startswith("tests/") for item in _existing(copy, selection)):
        # Without test files the selection would be the whole suite: report, do not run.
        return {
            "module": module,
            "tests": selection,
            "mutants": 0,
            "counts": {"no tests": 1},
            "survivors": {},
            "seconds": 0.0,
            "mutmut_exit": 0,
            "mutmut_tail": "",
        }
    work = Path(tempfile.mkdtemp(prefix="mutmut-", dir=copy.parent))
    shutil.copytree(copy, work, dirs_exist_ok=True)
    package = module.split("/")[0]
    others = [
        p
        for p in ("outbox/", "delivery/", "migrations/", "bench/", "config/")
        if p != package + "/"
    ]
    config = {
        "source_paths": [package + "/"],
        "only_mutate": [module],
        "also_copy": [p for p in others if (work / p).exists()],
        "pytest_add_cli_args_test_selection": _existing(work, selection),
        # -n 0: mutmut reads which tests ran in its own process (the suite's addopts run -n auto).
        "pytest_add_cli_args": [
            "-p",
            "no:cacheprovider",
            "-q",
            "-x",
            "-p",
            "no:randomly",
            "-n",
            "0",
        ],
    }
    lines = ["", "[tool.mutmut]"] + [
        f"{key} = {json.dumps(value)}" for key, value in config.items()
    ]
    with (work / "pyproject.toml").open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    began = time.monotonic()
    mutmut = [sys.executable, "-m", "mutmut"]
    globs = mutant_globs(module, only)
    children = ["--max-children", str(max_children)] if max_children else []
    run = subprocess.run(
        [*mutmut, "run", *children, *globs, *_function_globs(globs)],
        cwd=work,
        capture_output=True,
        text=True,
    )
    results = subprocess.run(
        [*mutmut, "results", "--all", "true"], cwd=work, capture_output=True, text=True
    ).stdout
    statuses: dict[str, str] = {}
    functions: set[str] = set()
    for line in results.splitlines():
        match = re.match(r"\s*(\S+): (.+)$", line)
        if match:
            functions.add(function_of(match.group(1)))
            if not globs or selected(match.group(1), globs):
                statuses[match.group(1)] = match.group(2).strip()
    survivors = {}
    for name, status in statuses.items():
        if status in ("survived", "no tests", "timeout", "suspicious"):
            shown = subprocess.run(
                [*mutmut, "show", name], cwd=work, capture_output=True, text=True
            ).stdout
            survivors[name] = {"status": status, "diff": shown}
    counts: dict[str, int] = {}
    by_function: dict[str, dict[str, int]] = {}
    for name, status in statuses.items():
        counts[status] = counts.get(status, 0) + 1
        of = by_function.setdefault(function_of(name), {})
        of[status] = of.get(status, 0) + 1
    shutil.rmtree(work, ignore_errors=True)
    tail = failure_tail(run.returncode, run.stdout, run.stderr, counts)
    if only and not statuses:
        tail = no_match(module, only, functions) + "\n" + tail
    return {
        "module": module,
        "tests": selection,
        "only": list(only),
        "mutants": len(statuses),
        "counts": counts,
        "by_function": by_function,
        "survivors": survivors,
        "seconds": round(time.monotonic() - began, 1),
        "mutmut_exit": run.returncode,
        "mutmut_tail": tail,
    }


def no_match(module: str, only: Sequence[str], functions: set[str]) -> str:
    """What to say when `--only` selected nothing: the functions that have mutants."""
    having = ", ".join(sorted(functions)) or "none (mutmut generated no mutant)"
    return (
        f"no mutant of {module} matches --only {' '.join(only)}; functions with mutants: {having}"
    )


def _no_durability(url: str) -> None:
    """A throwaway server need not survive a power cut (as the suite's own, tests/conftest.py):
    every test clones the template with CREATE DATABASE, which checkpoints; with fsync on, a
    clone on a busy disk took minutes and the run stalled on it."""
    from sqlalchemy import create_engine, text

    from outbox.db import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(text(f"ALTER SYSTEM SET {setting} = off"))
        conn.execute(text("SELECT pg_reload_conf()"))
    engine.dispose()


def failure_tail(returncode: int, stdout: str, stderr: str, counts: dict[str, int]) -> str:
    """What mutmut said when the run proves nothing: it exited non-zero, or every mutant
    is "not checked" (its clean test run failed, which mutmut 3 reports on stdout with a
    zero exit: a flaky or warning-raising test in the subset). Empty when all is well."""
    every_unchecked = bool(counts) and set(counts) == {"not checked"}
    if not returncode and not every_unchecked:
        return ""
    said = (stdout + stderr)[-2000:]
    if every_unchecked:
        said = (
            "every mutant is 'not checked': mutmut's clean test run failed; run the "
            "module's test subset by hand to see why\n" + said
        )
    return said


def _sql_mutants(
    copy: Path, wanted: set[str] | None, match: str | None = None
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for mutant in SQL_MUTANTS:
        if wanted is not None and mutant.file not in wanted:
            continue
        if match is not None and match not in mutant.name:
            continue
        if not (copy / mutant.file).exists() and (copy / OLD_OQ).exists():
            # A revision from before outbox/sql/: all of outbox's SQL in one file.
            mutant = replace(
                mutant, file=OLD_OQ, old=mutant.old.replace("{in_scope(", "{_in_scope(")
            )
        path = copy / mutant.file
        original = path.read_text()
        mutated = apply_mutant(original, mutant)
        if mutated is None:
            results.append({"name": mutant.name, "status": "not applicable", "tests": []})
            print(f"  sql: {mutant.name}: not applicable (text not found)", flush=True)
            continue
        tests = _existing(copy, mutant.tests)
        if not any(item.startswith("tests/") for item in tests):
            results.append({"name": mutant.name, "status": "no tests", "tests": []})
            print(f"  sql: {mutant.name}: no tests in this revision", flush=True)
            continue
        path.write_text(mutated)
        began = time.monotonic()
        try:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "-p",
                    "no:cacheprovider",
                    "-n",
                    "0",
                    *tests,
                ],
                cwd=copy,
                capture_output=True,
                text=True,
                timeout=300,  # a hang is a kill: the tests did not pass
            )
            status = "killed" if done.returncode != 0 else "survived"
            summary = done.stdout.strip().splitlines()[-1:] if done.stdout else []
        except subprocess.TimeoutExpired:
            status, summary = "killed (timeout)", []
        finally:
            path.write_text(original)
        results.append(
            {
                "name": mutant.name,
                "status": status,
                "tests": tests,
                "summary": summary,
                "seconds": round(time.monotonic() - began, 1),
            }
        )
        print(f"  sql: {mutant.name}: {status}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: all of them)")
    parser.add_argument("--rev", help="a git revision to test instead of the working tree")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--no-sql", action="store_true", help="skip the SQL guard mutants")
    parser.add_argument("--sql-only", action="store_true", help="only the SQL guard mutants")
    parser.add_argument(
        "--sql-match", metavar="TEXT", help="only the SQL mutants whose name contains TEXT"
    )
    parser.add_argument(
        "--only",
        metavar="FUNCTION",
        action="append",
        default=[],
        help="only the mutants of this function: `name`, `Class.method`, wildcards allowed"
        " (`_Pool.*`), or a glob of mutmut's mutant names (with `__mutmut_`); repeatable",
    )
    parser.add_argument(
        "--tests",
        metavar="PATH",
        action="append",
        help="run these test files (or file::test ids) instead of the module's subset in"
        " MODULES: a narrower first pass; repeatable",
    )
    parser.add_argument(
        "--max-children", type=int, metavar="N", help="mutmut's parallel mutants (default: CPUs)"
    )
    args = parser.parse_args(argv)
    sql_files = sorted({mutant.file for mutant in SQL_MUTANTS})
    unknown = [m for m in args.modules if m not in MODULES and m not in sql_files]
    if unknown:
        parser.error(
            f"unknown module {unknown[0]!r}; choose from {', '.join([*MODULES, *sql_files])}"
        )
    modules = [m for m in (args.modules or list(MODULES)) if m in MODULES]
    if args.tests and len(modules) != 1:
        parser.error("--tests replaces one module's subset: name that module")
    if args.only:
        if len(modules) != 1:
            parser.error("--only selects functions of one module: name that module")
        try:
            mutant_globs(modules[0], args.only)
        except SelectorError as exc:
            parser.error(str(exc))

    if not args.sql_only and modules and importlib.util.find_spec("mutmut") is None:
        # Without it every module would report 0 mutants: a run that proves nothing.
        parser.error("mutmut is not installed: pip install -e '.[mutation]'")

    from outbox.embedded import EmbeddedPostgres

    report: dict[str, Any] = {"rev": args.rev or "working tree", "modules": [], "sql": []}
    with tempfile.TemporaryDirectory(prefix="outbox-mutation-") as scratch:
        root = Path(scratch)
        copy = root / "tree"
        copy.mkdir()
        _export(args.rev, copy)
        server = EmbeddedPostgres(root / "pg", delete_on_stop=True)
        os.environ["OUTBOX_TEST_DATABASE_URL"] = server.start()
        _no_durability(os.environ["OUTBOX_TEST_DATABASE_URL"])
        try:
            if not args.sql_only:
                for module in modules:
                    print(f"mutmut: {module}", flush=True)
                    result = _mutmut_module(
                        copy, module, args.tests or MODULES[module], args.only, args.max_children
                    )
                    report["modules"].append(result)
                    if args.out:  # a long run keeps what it has so far
                        args.out.write_text(json.dumps(report, indent=2) + "\n")
                    print(
                        f"  {result['mutants']} mutants, {result['counts']}, {result['seconds']} s",
                        flush=True,
                    )
                    if result["mutmut_tail"]:
                        print(result["mutmut_tail"], file=sys.stderr, flush=True)
            if not args.no_sql:
                wanted = set(args.modules) & set(sql_files) if args.modules else None
                report["sql"] = _sql_mutants(copy, wanted, args.sql_match)
        finally:
            server.stop()
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    # A module whose mutmut run failed, or proved nothing, fails the command too.
    return 1 if any(result["mutmut_tail"] for result in report["modules"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
