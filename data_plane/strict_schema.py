"""What OpenAI's strict mode asks of a JSON schema, checked before anything is compiled.

    strict_schema_problem({"type": "object", "properties": {"a": {"type": "string"}}})
    # "In context=(), 'additionalProperties' is required to be supplied and to be false."

A ``response_format`` ``json_schema`` or a function tool with ``strict: true`` promises the client that
the schema as sent is the contract (OpenAI: "Supported schemas" of the Structured Outputs guide): every
object says ``additionalProperties: false`` and lists every key of its ``properties`` in ``required``, and a
string's ``format`` is one strict mode supports (`STRICT_FORMATS`).
OpenAI answers a schema that breaks either rule with a 400 before generating anything, in the words
used here (so a client's error handling, and a developer's search for the message, work the same).
Without ``strict`` the grammar still enforces the schema, objects closed (`schema_rewrite.closed`).

The clients that send strict schemas build them to these rules: the openai SDK's ``parse`` and
``pydantic_function_tool`` (``to_strict_json_schema``), the Agents SDK (``ensure_strict_json_schema``),
LangChain's ``strict=True`` (``_recursive_set_additional_properties_false``).
"""

from __future__ import annotations

from typing import Any

STRICT_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                            "uri"})
"""The string formats strict mode takes: OpenAI's nine, and "uri" (pydantic's AnyUrl/HttpUrl), which the grammar
enforces too (OpenAI refuses it; refusing a format we can keep would only break apps here). Another is a 400 in
OpenAI's words ("'uri-reference' is not a valid format")."""
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def object_root_problem(schema: dict[str, Any]) -> str | None:
    """OpenAI's words for a schema whose root is not an object's (``anyOf`` at the root, an array, no
    type), or None. A function's arguments and a strict response format are objects. A root that is only
    a local ``$ref`` (a recursive pydantic model's) is read through to the schema it names."""
    root = schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
        head, _, name = ref[2:].partition("/")
        defs = schema.get(head)
        root = defs.get(name, schema) if isinstance(defs, dict) else schema
    kind = root.get("type") if isinstance(root, dict) else None
    if kind == "object":
        return None
    return f"schema must be a JSON Schema of 'type: \"object\"', got 'type: \"{kind}\"'."


def strict_schema_problem(schema: Any, path: tuple[str | int, ...] = ()) -> str | None:
    """The first rule of strict mode `schema` breaks, as OpenAI words it, or None: the root is an
    object's schema, then objects are checked before what they contain, in the schema's own key order."""
    if not isinstance(schema, dict):
        return None
    if not path and (problem := object_root_problem(schema)) is not None:
        return problem
    if isinstance(schema.get("format"), str) and schema["format"] not in STRICT_FORMATS:
        return f"In context={path!r}, '{schema['format']}' is not a valid format."
    if _is_object(schema):
        if schema.get("additionalProperties") is not False:
            return f"In context={path!r}, 'additionalProperties' is required to be supplied and to be false."
        properties = schema.get("properties")
        required = schema.get("required")
        if isinstance(properties, dict):
            listed = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) \
                else set()
            missing = [key for key in properties if key not in listed]
            if missing:
                return (f"In context={path!r}, 'required' is required to be supplied and to be an array "
                        f"including every key in properties. Missing '{missing[0]}'.")
    for key, value in schema.items():
        found: str | None = None
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if (found := strict_schema_problem(sub, (*path, key, name))) is not None:
                    break
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                if (found := strict_schema_problem(sub, (*path, key, i))) is not None:
                    break
        elif key == "items":
            subs = value if isinstance(value, list) else [value]
            for i, sub in enumerate(subs):
                where = (*path, key, i) if isinstance(value, list) else (*path, key)
                if (found := strict_schema_problem(sub, where)) is not None:
                    break
        if found is not None:
            return found
    return None
