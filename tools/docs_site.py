"""mkdocs hooks for the documentation site (mkdocs.yml `hooks:`).

Two pages hold generated parts, so they cannot drift from the code: the admin API
reference is rendered from the OpenAPI document the admin server serves
(`delivery.operator.api.openapi_document()`, also published beside it as
`reference/openapi.json`), and the architecture page's code map is the first line of
each module's own docstring.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
OPENAPI_MARKER = "<!-- openapi -->"
CODE_MAP_MARKER = "<!-- code-map -->"
# The packages the code map covers, in reading order, with what each is for.
CODE_MAP_PACKAGES = {
    "outbox": "what applications import: publish(), the schema, the relay, settings",
    "delivery": "the send path: worker, HTTP attempt, wire, rules, breakers, SSRF guard",
    "delivery/operator": "the operator side: CLI, admin API, console and portal, metrics",
    "bench": "the benchmark (`python -m bench`)",
    "tools": "development tools: mutation testing, the previous release, this site",
}
METHODS = ("get", "post", "put", "patch", "delete")


def openapi_document() -> dict[str, Any]:
    """Imported late: the site's build is the only caller, and it needs the package."""
    from delivery.operator.api import openapi_document as document

    return document()


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Publish the OpenAPI document itself next to its rendered page."""
    text = json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"
    files.append(File.generated(config, "reference/openapi.json", content=text))
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    if OPENAPI_MARKER in markdown:
        markdown = markdown.replace(OPENAPI_MARKER, render_openapi(openapi_document()))
    if CODE_MAP_MARKER in markdown:
        markdown = markdown.replace(CODE_MAP_MARKER, render_code_map(ROOT))
    return markdown


def _cell(text: object) -> str:
    """Table cells stay on one line and keep their pipes literal."""
    return " ".join(str(text).split()).replace("|", "\\|")


def schema_type(schema: dict[str, Any]) -> str:
    """A short human name for a JSON Schema: `integer`, `array of string`, `A or null`."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return " or ".join(schema_type(option) for option in schema[combinator])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{value}`" for value in schema["enum"])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    if kind == "array":
        return "array of " + schema_type(schema.get("items", {}))
    if "format" in schema:
        return f"{kind} ({schema['format']})"
    return str(kind)


def _resolve(schema: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    """Follow one local `$ref` (`#/components/schemas/X`, `#/$defs/X`) if there is one."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    target: Any = document
    for part in ref[2:].split("/"):
        target = target.get(part, {}) if isinstance(target, dict) else {}
    return target if isinstance(target, dict) else schema


def _body_table(schema: dict[str, Any], document: dict[str, Any]) -> list[str]:
    schema = _resolve(schema, document)
    properties: dict[str, Any] = schema.get("properties", {})
    if not properties:
        return [f"Body: {schema_type(schema)}.", ""]
    required = set(schema.get("required", []))
    lines = ["| field | type | required | description |", "|---|---|---|---|"]
    for name, prop in properties.items():
        lines.append(
            f"| `{name}` | {_cell(schema_type(prop))} | {'yes' if name in required else 'no'} "
            f"| {_cell(prop.get('description', ''))} |"
        )
    return [*lines, ""]


def render_openapi(document: dict[str, Any]) -> str:
    info = document.get("info", {})
    lines = [f"**{info.get('title', 'API')}**, version {info.get('version', '?')}.", ""]
    if info.get("description"):
        lines += [str(info["description"]), ""]
    for path, item in document.get("paths", {}).items():
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            lines += [f"## `{method.upper()} {path}`", "", str(operation.get("summary", "")), ""]
            role = operation.get("x-required-role")
            lines += [f"Role: {role} (bearer token)." if role else "No token needed.", ""]
            parameters = operation.get("parameters", [])
            if parameters:
                lines += ["| parameter | in | type | required | description |"]
                lines += ["|---|---|---|---|---|"]
                for p in parameters:
                    lines.append(
                        f"| `{p['name']}` | {p.get('in', '')} | "
                        f"{_cell(schema_type(p.get('schema', {})))} | "
                        f"{'yes' if p.get('required') else 'no'} | "
                        f"{_cell(p.get('description', ''))} |"
                    )
                lines.append("")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                lines += ["Request body (JSON):", ""]
                lines += _body_table(body.get("schema", {}), document)
            responses = operation.get("responses", {})
            lines += [
                "Responses: "
                + "; ".join(
                    f"{code} {_cell(answer.get('description', ''))}"
                    for code, answer in sorted(responses.items())
                )
                + ".",
                "",
            ]
    return "\n".join(lines)


def _first_docstring_line(path: Path) -> str:
    try:
        docstring = ast.get_docstring(ast.parse(path.read_text()))
    except SyntaxError:
        return ""
    return docstring.strip().split("\n\n", 1)[0].replace("\n", " ") if docstring else ""


def render_code_map(root: Path) -> str:
    """One table per package: each module and the first paragraph of its docstring."""
    lines: list[str] = []
    for package, purpose in CODE_MAP_PACKAGES.items():
        lines += [f"### `{package}/`", "", purpose[0].upper() + purpose[1:] + ".", ""]
        lines += ["| module | what it is for |", "|---|---|"]
        base = root / package
        for path in sorted(base.rglob("*.py")):
            relative = path.relative_to(root)
            nested = path.relative_to(base).parts[:-1]
            if nested and f"{package}/{nested[0]}" in CODE_MAP_PACKAGES:
                continue  # listed under its own package
            lines.append(f"| `{relative}` | {_cell(_first_docstring_line(path))} |")
        lines.append("")
    return "\n".join(lines)
