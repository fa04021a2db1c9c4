"""What an event type's JSON Schema may hold, and payload validation within a time budget.

Schemas come from operators (the CLI, the admin API) and run on every payload publish()
and the relay check, so what could hurt is refused when a schema is added, not found out
while publishing:

- References that leave the schema. A `$ref` is either `#...` (inside the schema) or
  `urn:outbox:event-type:NAME:VERSION` (a catalogued version, pinned: versions never
  change). Catalogue references are bundled into the stored schema (a `$defs` entry keyed
  by the urn, with that `$id`), so validation never looks anything up. `$dynamicRef` is
  `#...` only; `$id` exists only on those bundled entries; `$schema` only at the root and
  only Draft 2020-12. The registry has no retrieval at all: nothing ever opens a URL or a
  file for a schema, and error text can only quote the schema and the payload.
- Patterns the linear-time engine cannot run. `pattern`, `patternProperties` (and the
  `regex` format) run on RE2, so matching time grows linearly with the text; patterns RE2
  refuses (backreferences, lookaround) are refused. `unevaluatedProperties` is refused
  beside `patternProperties` (jsonschema would run those patterns on Python's `re`).
- Size, depth and keyword count over the caps (SchemaLimits, OUTBOX_MAX_SCHEMA_*).

Validating one payload has a time budget, checked before every keyword the validator
runs: with RE2, the linear `uniqueItems` below and the caps, no single keyword runs for
long, but `$ref`s can still multiply work (a schema a few hundred bytes long can ask for
2**30 evaluations), and a clock check between keywords stops that at the budget without
a thread or a process to kill (a thread cannot be stopped; a process per payload costs
milliseconds). See docs/schema-rules.md for the measurements.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import re2
import referencing.jsonschema
from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable

from outbox.errors import CatalogueError

CATALOGUE_URN = "urn:outbox:event-type:"
_URN = re.compile(
    r"^urn:outbox:event-type:([A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9][A-Za-z0-9_-]*)*)"
    r":([1-9][0-9]{0,8})$"
)
DIALECT = "https://json-schema.org/draft/2020-12/schema"
_DIALECTS = (DIALECT, DIALECT + "#")
DEFAULT_VALIDATION_BUDGET = 0.1  # seconds; OUTBOX_VALIDATION_BUDGET_MS

_IN_VALUE = (
    "additionalProperties", "contains", "contentSchema", "else", "if", "items", "not",
    "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
_IN_SUBARRAY = ("allOf", "anyOf", "oneOf", "prefixItems")
_IN_SUBVALUES = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """Caps checked when a schema is added (OUTBOX_MAX_SCHEMA_BYTES/_DEPTH/_KEYWORDS)."""

    max_bytes: int = 256 * 1024
    max_depth: int = 32
    max_keywords: int = 10_000


@dataclass(frozen=True, slots=True, order=True)
class CatalogueRef:
    """A `$ref` to one version of another catalogued type."""

    name: str
    version: int

    @property
    def urn(self) -> str:
        return f"{CATALOGUE_URN}{self.name}:{self.version}"


def catalogue_ref(value: str) -> CatalogueRef | None:
    """The type and version a `urn:outbox:event-type:NAME:VERSION` names, else None."""
    match = _URN.match(value)
    return CatalogueRef(match[1], int(match[2])) if match else None


# -- RE2 ----------------------------------------------------------------------------------

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # refusals are reported to the caller, not to stderr


@functools.lru_cache(maxsize=2048)
def _regex(pattern: str) -> Any:
    return re2.compile(pattern, _RE2_OPTIONS)


def pattern_problem(pattern: str) -> str | None:
    """Why RE2 cannot run `pattern` (backreference, lookaround, too large), or None."""
    try:
        _regex(pattern)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        return reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    return None


# -- the time budget ------------------------------------------------------------------------


class BudgetExceededError(Exception):
    """Validation of one payload ran past its budget (internal: turned into a refusal)."""


class _Deadline(threading.local):
    at: float | None = None
    timer: Callable[[], float] = time.perf_counter


_DEADLINE = _Deadline()


def _tick() -> None:
    at = _DEADLINE.at
    if at is not None and _DEADLINE.timer() > at:
        raise BudgetExceededError


Keyword = Callable[[Any, Any, Any, Any], Any]


def _budgeted(keyword: Keyword) -> Keyword:
    def checked(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _tick()
        return keyword(validator, value, instance, schema)

    return checked


# -- keywords that must not reach Python's `re` or run in quadratic time -------------------


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and _regex(pattern).search(instance) is None:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _regex(pattern)
        for key, value in instance.items():
            _tick()
            if regex.search(key) is not None:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional(instance: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    properties = schema.get("properties", {})
    patterns = [_regex(p) for p in schema.get("patternProperties", {})]
    extras = []
    for key in instance:
        _tick()
        if key not in properties and not any(r.search(key) is not None for r in patterns):
            extras.append(key)
    return extras


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: Any
) -> Iterator[Any]:
    """jsonschema's additionalProperties, with patternProperties matched on RE2."""
    if not validator.is_type(instance, "object"):
        return
    extras = _additional(instance, schema)
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        names = ", ".join(repr(extra) for extra in sorted(extras))
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            patterns = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            yield ValidationError(f"{names} {verb} not match any of the regexes: {patterns}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({names} {verb} unexpected)"
            )


def _json_key(value: Any) -> Any:
    """A hashable key equal for JSON-equal values (1 == 1.0, true != 1, keys unordered)."""
    if value is True or value is False:
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(_json_key(item) for item in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _json_key(v)) for k, v in value.items()))
    return ("null", None)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """Linear (one hash per item), not jsonschema's pairwise comparison of unhashables."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _json_key(item)
        if key in seen:
            yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


FORMAT_CHECKER = FormatChecker()
FORMAT_CHECKER.checkers = dict(Draft202012Validator.FORMAT_CHECKER.checkers)


def _is_regex(instance: object) -> bool:
    """The `regex` format means what `pattern` runs: RE2 (not cached: payload text)."""
    if isinstance(instance, str):
        re2.compile(instance, _RE2_OPTIONS)
    return True


FORMAT_CHECKER.checks("regex", raises=re2.error)(_is_regex)
# For the meta-schema check: patterns are checked by the walk, which names RE2's reason.
_META_FORMAT_CHECKER = FormatChecker()
_META_FORMAT_CHECKER.checkers = {
    name: check for name, check in FORMAT_CHECKER.checkers.items() if name != "regex"
}


_KEYWORDS: dict[str, Keyword] = {
    name: _budgeted(keyword) for name, keyword in Draft202012Validator.VALIDATORS.items()
}
_KEYWORDS.update(
    pattern=_budgeted(_pattern),
    patternProperties=_budgeted(_pattern_properties),
    additionalProperties=_budgeted(_additional_properties),
    uniqueItems=_budgeted(_unique_items),
)
CatalogueValidator: Any = validators.extend(Draft202012Validator, _KEYWORDS)


def _refuse_retrieval(uri: str) -> Resource[Any]:
    """The registry's only way to fetch: never (every reference is inside the schema)."""
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


REGISTRY: Registry[Any] = Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]


# -- checks at add time ---------------------------------------------------------------------


def _where(path: tuple[str | int, ...]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def check_shape(schema: Any, limits: SchemaLimits) -> None:
    """Depth and keyword count without recursion (a 5 MB or 10,000-level schema is refused
    before anything else reads it), then the size of its JSON text."""
    if not isinstance(schema, dict):
        raise CatalogueError(
            f"a schema must be a JSON object (a JSON Schema), not {type(schema).__name__}"
        )
    keywords = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limits.max_depth:
                raise CatalogueError(
                    f"the schema nests deeper than {limits.max_depth} levels: flatten it "
                    "(reuse parts through $defs and $ref), or raise OUTBOX_MAX_SCHEMA_DEPTH"
                )
            items = value.values() if isinstance(value, dict) else value
            if isinstance(value, dict):
                keywords += len(value)
                if keywords > limits.max_keywords:
                    raise CatalogueError(
                        f"the schema has more than {limits.max_keywords} keywords: split the "
                        "event type, or raise OUTBOX_MAX_SCHEMA_KEYWORDS"
                    )
            stack.extend((item, depth + 1) for item in items)
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
    if size > limits.max_bytes:
        raise CatalogueError(
            f"the schema is {size} bytes, over the {limits.max_bytes}-byte limit: send ids in "
            "payloads, not documents, or raise OUTBOX_MAX_SCHEMA_BYTES"
        )


def _check_dialect(schema: dict[str, Any]) -> None:
    try:
        Draft202012Validator.check_schema(schema, format_checker=_META_FORMAT_CHECKER)
    except SchemaError as exc:
        raise CatalogueError(
            f"the schema is not valid JSON Schema (Draft 2020-12) at "
            f"{_where(tuple(exc.absolute_path))}: {exc.message}"
        ) from exc


_LEAVES = (
    "a catalogue schema refers only to itself ('#/$defs/...') or to a version of another "
    "event type ('urn:outbox:event-type:NAME:VERSION'); nothing is fetched from a URL or a file"
)


@dataclass(slots=True)
class _Walk:
    """Every schema the validator can reach, with where it is and how references resolve."""

    refs: set[CatalogueRef]
    seen: set[int]
    has_pattern_properties: bool = False
    unevaluated_at: str | None = None


def _children(
    node: dict[str, Any], path: tuple[str | int, ...]
) -> Iterator[tuple[Any, tuple[str | int, ...], str | None]]:
    """(subschema, its path, the $defs key when it is a $defs entry)."""
    for keyword in _IN_VALUE:
        if keyword in node:
            yield node[keyword], (*path, keyword), None
    for keyword in _IN_SUBARRAY:
        if isinstance(node.get(keyword), list):
            for index, sub in enumerate(node[keyword]):
                yield sub, (*path, keyword, index), None
    for keyword in _IN_SUBVALUES:
        if isinstance(node.get(keyword), dict):
            for name, sub in node[keyword].items():
                yield sub, (*path, keyword, name), name if keyword == "$defs" else None


def _check_reference(
    walk: _Walk,
    stack: list[Any],
    resolver: Any,
    keyword: str,
    ref: str,
    where: str,
    *,
    bundled: bool,
) -> None:
    """Refuse a reference that leaves the schema; follow one that stays inside."""
    target = catalogue_ref(ref.partition("#")[0])
    if not ref.startswith("#") and (target is None or keyword != "$ref"):
        raise CatalogueError(f"{keyword} {ref!r} at {where} leaves the schema: {_LEAVES}")
    try:
        resolved = resolver.lookup(ref)
    except Unresolvable:
        if target is not None and not ref.partition("#")[2]:
            if not bundled:
                walk.refs.add(target)  # bundled from the catalogue before it is stored
            return
        raise CatalogueError(
            f"{keyword} {ref!r} at {where} points to nothing in the schema: fix the "
            "JSON pointer or anchor"
        ) from None
    if target is not None and not bundled:
        walk.refs.add(target)
    key = target.urn if target is not None else None  # a bundled entry may carry its $id
    stack.append((resolved.contents, (f"<{ref}>",), key, resolved.resolver, bundled))


def _check_node(walk: _Walk, stack: list[Any], item: tuple[Any, ...], root: bool) -> None:
    node, path, defs_key, resolver, bundled = item
    where = _where(path)
    if "$schema" in node and (not root or node["$schema"] not in _DIALECTS):
        raise CatalogueError(
            f"$schema {node['$schema']!r} at {where}: only the root may name a dialect, and "
            f"only Draft 2020-12 ({DIALECT}); remove it"
        )
    if "$id" in node:
        identity = node["$id"]
        if defs_key != identity or catalogue_ref(str(identity)) is None:
            raise CatalogueError(
                f"$id {identity!r} at {where}: a catalogue schema is named by its event type "
                "and cannot point elsewhere; remove $id (to reuse another type's schema, "
                "$ref 'urn:outbox:event-type:NAME:VERSION')"
            )
        bundled = True
    resolver = resolver.in_subresource(referencing.jsonschema.DRAFT202012.create_resource(node))
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if isinstance(ref, str):
            _check_reference(walk, stack, resolver, keyword, ref, where, bundled=bundled)
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        walk.has_pattern_properties = True
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        problem = pattern_problem(pattern)
        if problem is not None:
            raise CatalogueError(
                f"pattern {pattern!r} at {where} cannot run on the linear-time regex engine "
                f"(RE2: {problem}): rewrite it without backreferences or lookaround"
            )
    if "unevaluatedProperties" in node:
        walk.unevaluated_at = where
    for sub, sub_path, key in _children(node, path):
        stack.append((sub, sub_path, key, resolver, bundled))


def check_references_and_patterns(schema: dict[str, Any]) -> set[CatalogueRef]:
    """Refuse what leaves the schema or cannot run in linear time; the catalogue versions
    the schema refers to (outside any entry already bundled in it)."""
    walk = _Walk(refs=set(), seen=set())
    root_resolver = REGISTRY.resolver_with_root(
        referencing.jsonschema.DRAFT202012.create_resource(schema)
    )
    stack: list[Any] = [(schema, (), None, root_resolver, False)]
    while stack:
        item = stack.pop()
        node = item[0]
        if not isinstance(node, dict) or id(node) in walk.seen:
            continue
        walk.seen.add(id(node))
        _check_node(walk, stack, item, root=node is schema)
    if walk.unevaluated_at is not None and walk.has_pattern_properties:
        raise CatalogueError(
            f"unevaluatedProperties at {walk.unevaluated_at} cannot be combined with "
            "patternProperties in one schema (jsonschema would run those patterns outside the "
            "linear-time engine): use additionalProperties beside patternProperties"
        )
    return walk.refs


def vet_schema(schema: Any, limits: SchemaLimits) -> set[CatalogueRef]:
    """CatalogueError unless `schema` keeps every rule above; the catalogue versions it needs."""
    check_shape(schema, limits)
    _check_dialect(schema)
    return check_references_and_patterns(schema)


def bundle(
    schema: dict[str, Any], versions: Mapping[CatalogueRef, dict[str, Any]]
) -> dict[str, Any]:
    """`schema` with each referenced catalogue version embedded under `$defs[urn]`."""
    if not versions:
        return schema
    defs = dict(schema.get("$defs") or {})
    for ref, contents in sorted(versions.items()):
        entry = {key: value for key, value in contents.items() if key != "$schema"}
        defs[ref.urn] = {"$id": ref.urn, **entry}
    return {**schema, "$defs": defs}


# -- validation -------------------------------------------------------------------------------


def _without_dialect(schema: dict[str, Any]) -> dict[str, Any]:
    """The root's `$schema` would make jsonschema pick its own class (Python's `re`) again
    whenever a `$ref` reaches the root, and its `$id` only names it: drop both. Schemas
    added under these rules have neither (bar Draft 2020-12's `$schema`); ones stored
    before them were always validated as Draft 2020-12, and keep being so."""
    if "$schema" not in schema and "$id" not in schema:
        return schema
    return {key: value for key, value in schema.items() if key not in ("$schema", "$id")}


@dataclass(frozen=True, slots=True)
class CompiledSchema:
    """A stored schema ready to validate payloads; `refusal` when it breaks the rules (a
    schema stored before they existed): every payload is then refused with that reason."""

    schema: dict[str, Any]
    validator: Any = None
    refusal: str | None = None

    def problem(
        self, payload: Any, *, budget: float, timer: Callable[[], float] = time.perf_counter
    ) -> str | None:
        """One line naming the JSON path and rule the payload breaks, or None if it is valid."""
        return self._run(payload, budget, timer, first_only=False)

    def is_valid(
        self, payload: Any, *, budget: float, timer: Callable[[], float] = time.perf_counter
    ) -> bool:
        return self._run(payload, budget, timer, first_only=True) is None

    def _run(
        self, payload: Any, budget: float, timer: Callable[[], float], *, first_only: bool
    ) -> str | None:
        if self.refusal is not None:
            return self.refusal
        _DEADLINE.timer = timer
        _DEADLINE.at = timer() + budget
        try:
            errors = self.validator.iter_errors(payload)
            error = next(errors, None) if first_only else best_match(errors)
        except BudgetExceededError:
            return (
                f"validation took longer than its {budget * 1000:g} ms budget "
                "(OUTBOX_VALIDATION_BUDGET_MS): simplify the schema (fewer nested $refs and "
                "combinators) or publish a smaller payload"
            )
        except RecursionError:
            return "the schema and payload nest too deeply to validate: publish it flatter"
        except Unresolvable as exc:  # only a schema stored before the rules can get here
            return f"the schema refers to {exc.ref!r}, which is not in it: {_LEAVES}"
        finally:
            _DEADLINE.at = None
        if error is None:
            return None
        return f"at {error.json_path}: {error.message} (rule '{error.validator}')"


def compile_schema(schema: dict[str, Any]) -> CompiledSchema:
    """Compile a stored schema; one that breaks today's rules refuses every payload."""
    runnable = _without_dialect(schema)
    try:
        refs = check_references_and_patterns(runnable)
    except CatalogueError as exc:
        return CompiledSchema(schema, refusal=f"its schema breaks the catalogue's rules: {exc}")
    bundled = schema.get("$defs") or {}
    missing = ", ".join(ref.urn for ref in sorted(refs) if ref.urn not in bundled)
    if missing:
        return CompiledSchema(schema, refusal=f"its schema refers to {missing}, not bundled in it")
    validator = CatalogueValidator(runnable, registry=REGISTRY, format_checker=FORMAT_CHECKER)
    return CompiledSchema(schema, validator)
