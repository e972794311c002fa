"""How a client's JSON schema is rewritten before it becomes a grammar (data_plane/structured.py builds
the grammar's source from what these return).

    closed({"type": "object", "properties": {"a": {"type": "integer"}}})
    # {"type": "object", "properties": {"a": {"type": "integer", "minimum": -(2**53 - 1), ...}},
    #  "additionalProperties": False}
    hoist(parameters, "t0_", defs)     # the schema, to nest in the tool-call envelope; its $defs into `defs`

Both walk the schema recursively: `structured.check_output_fields` refuses one nested deeper than the
grammar compiler takes (`structured.MAX_SCHEMA_DEPTH`) before either runs.
"""

from __future__ import annotations

from typing import Any

SAFE_INTEGER = 2**53 - 1
"""JSON's portable integer range (+-): the bounds an unbounded ``integer`` gets."""
GRAMMAR_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
"""The string formats the grammar compiler (llguidance) enforces. Any other is an annotation, as JSON Schema
reads a format by default: dropped, the string served as a plain one (strict mode allows OpenAI's nine only)."""


def hoist(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` to be nested in the envelope: its `$defs`/`definitions` move to the root's `defs` under
    `prefix` and its local refs are rewritten to match: "#/$defs/X..." and "#/definitions/X..." to the
    moved definition, "#" and any other pointer ("#/properties/a", as zod-to-json-schema writes a schema
    used twice) into a copy of the schema itself, kept in `defs` as `prefix`root (`prefix`root_ where the
    schema has a definition named root; left as sent, such a pointer named a place in the envelope, and a
    schema served alone was refused there)."""
    schema = dict(schema)
    own = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
    whole = prefix + "root"
    while whole[len(prefix):] in own:  # a definition of the schema's own may be called root
        whole += "_"

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                moved = next((head for head in ("#/$defs/", "#/definitions/") if ref.startswith(head)), None)
                if moved is not None:
                    out["$ref"] = "#/$defs/" + prefix + ref[len(moved):]
                else:
                    out["$ref"] = f"#/$defs/{whole}" + ref[1:]
                    defs.setdefault(whole, None)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    body = walk(schema)
    for name, sub in own.items():
        defs[prefix + name] = walk(sub)
    if whole in defs and defs[whole] is None:
        defs[whole] = body
    return body


def annotated_formats(schema: Any) -> Any:
    """`schema` without the string formats the grammar does not know, wherever they sit (`closed` drops them
    only where it recurses: a dict's values, ``additionalProperties``, kept "Unknown format: path", a 400)."""
    if isinstance(schema, list):
        return [annotated_formats(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples") else annotated_formats(v) for k, v in schema.items()}
    if isinstance(out.get("format"), str) and out["format"] not in GRAMMAR_FORMATS:
        del out["format"]
    return out


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with every object that lists `properties` and says nothing of `additionalProperties` closed
    (``additionalProperties: false``, as OpenAI's strict mode requires of every object): a model then
    writes the listed keys, not keys of its own. Say ``additionalProperties: true`` to allow extra keys.
    Members of an ``allOf`` are left open (closing them would contradict each other). An unbounded
    ``integer`` gets JSON's portable range (+-(2**53 - 1), 16 digits), so a small model cannot write digits
    until the token limit. A `format` the grammar does not know (pydantic's "password", "path", "binary", an MCP
    tool's "uri-reference") is dropped: it was a 400 "Unknown format" where OpenAI serves the schema."""
    if isinstance(schema, list):
        return [closed(v, in_all_of) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v, k == "allOf") if k in ("allOf", "anyOf", "oneOf", "items", "prefixItems") else
           {n: closed(d) for n, d in v.items()} if k in ("properties", "$defs", "definitions") and isinstance(v, dict)
           else v for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out and "patternProperties" not in out
            and not in_all_of):
        out["additionalProperties"] = False
    if isinstance(out.get("format"), str) and out["format"] not in GRAMMAR_FORMATS:
        del out["format"]
    if isinstance(out.get("additionalProperties"), dict):  # a dict's values (pydantic's dict[str, Path]): their
        out["additionalProperties"] = annotated_formats(out["additionalProperties"])  # formats only, left open
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out
