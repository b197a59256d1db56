"""A task's answer schema: the fields it extracts, as the JSON Schema vLLM's structured outputs
enforce, the validator checks and the typed `fields/<task>` table follows.

A task gives either `schema:` (a JSON Schema: a mapping, a JSON string, or a .json/.yaml
file relative to the job file) or `fields:`, a compact form:

    fields:
      vendor: string
      total: number
      date: date            # also: integer, boolean, datetime
      paid: boolean
      currency: [EUR, USD]  # one of these strings
      notes: string?        # ?: may be null
      lines: list[string]   # a list; list[{...}] is not offered: write a JSON Schema
      address: {street: string, city: string}   # an object

Every compact field is required and no others are allowed. Either way the schema is checked
when the job is loaded: a valid JSON Schema (Draft 2020-12), an object with properties at
the top, built only from what maps to a typed column (`column_kinds` below), and no field
named like a key column of the fields table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

KEY_COLUMNS = ("source", "page", "task", "run_id", "finished_at", "content_hash")
COMPACT_TYPES = {
    "string": {"type": "string"},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "date": {"type": "string", "format": "date"},
    "datetime": {"type": "string", "format": "date-time"},
}
_LIST = re.compile(r"^list\[(.+)\]$")


class SchemaProblem(ValueError):
    """A schema that cannot be used, with where in it (a dotted field path)."""


def compact_to_json_schema(fields: dict, where: str = "") -> dict:
    """The compact field list as a JSON Schema (every field required, no others)."""
    if not isinstance(fields, dict) or not fields:
        raise SchemaProblem(f"{where or 'fields'}: a mapping of field name to type, not empty")
    properties = {}
    for name, spec in fields.items():
        path = f"{where}.{name}" if where else str(name)
        properties[str(name)] = _compact_field(spec, path)
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _compact_field(spec, path: str) -> dict:
    if isinstance(spec, dict):
        return compact_to_json_schema(spec, path)
    if isinstance(spec, list):
        if not spec or not all(isinstance(v, str) for v in spec):
            raise SchemaProblem(f"field '{path}': a list of allowed strings, not empty")
        return {"type": "string", "enum": list(spec)}
    if not isinstance(spec, str):
        raise SchemaProblem(f"field '{path}': a type name, a list of strings or a mapping")
    text = spec.strip()
    nullable = text.endswith("?")
    text = text.rstrip("?").strip()
    listed = _LIST.match(text)
    if listed:
        schema = {"type": "array", "items": _compact_field(listed[1].strip(), f"{path}[]")}
    elif text in COMPACT_TYPES:
        schema = dict(COMPACT_TYPES[text])
    else:
        raise SchemaProblem(f"field '{path}': unknown type '{spec}' (known: "
                            f"{', '.join(COMPACT_TYPES)}, list[T], [a, b] for one of, a mapping "
                            f"for an object, ? for nullable)")
    if nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def load_schema(value, base_dir: Path | None) -> dict:
    """`schema:` as written: a mapping, a JSON string, or a file (relative to base_dir)."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str) or not value.strip():
        raise SchemaProblem("a JSON Schema mapping, or the path of a .json or .yaml file")
    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise SchemaProblem(f"not valid JSON: {e}") from None
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        text = path.read_text()
    except OSError as e:
        raise SchemaProblem(f"cannot read schema file {path}: {e.strerror or e}") from None
    try:
        loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise SchemaProblem(f"schema file {path} does not parse: {e}") from None
    if not isinstance(loaded, dict):
        raise SchemaProblem(f"schema file {path}: a JSON Schema object, got "
                            f"{type(loaded).__name__}")
    return loaded


def check_schema(schema: dict) -> None:
    """Refuse a schema vlbatch cannot enforce and type (SchemaProblem says where)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise SchemaProblem(f"not a valid JSON Schema at {where}: {e.message}") from None
    if schema.get("type") != "object" or not isinstance(schema.get("properties"), dict) \
            or not schema["properties"]:
        raise SchemaProblem('the top level must be an object with properties ({"type": '
                            '"object", "properties": {...}}): its fields become columns')
    column_kind(schema, "(top level)")
    clash = sorted(set(schema["properties"]) & set(KEY_COLUMNS))
    if clash:
        raise SchemaProblem(f"field '{clash[0]}' is named like a key column of the fields "
                            f"table ({', '.join(KEY_COLUMNS)}): rename it")


def column_kind(schema: dict, path: str) -> tuple:
    """What a (sub)schema becomes as a column, as nested tuples:
    ("string" | "integer" | "number" | "boolean" | "date" | "datetime",),
    ("list", item_kind), ("object", ((name, kind), ...)). Nullability is not kept: every
    column may hold nulls (a field not required, or null allowed)."""
    if not isinstance(schema, dict):
        raise SchemaProblem(f"field '{path}': a schema object")
    inner = _without_null(schema, path)
    if inner is not schema:
        return column_kind(inner, path)
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        values = [v for v in schema["enum"] if v is not None]
        if values and all(isinstance(v, str) for v in values):
            return ("string",)
        raise SchemaProblem(f"field '{path}': an enum of strings only (typed columns)")
    if kind == "string":
        fmt = schema.get("format")
        return ("date",) if fmt == "date" else ("datetime",) if fmt == "date-time" else ("string",)
    if kind in ("integer", "number", "boolean"):
        return (kind,)
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            raise SchemaProblem(f"field '{path}': an array needs `items`, one schema")
        return ("list", column_kind(items, f"{path}[]"))
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise SchemaProblem(f"field '{path}': an object needs `properties`")
        return ("object", tuple((name, column_kind(sub, name if path == "(top level)"
                                                   else f"{path}.{name}"))
                                for name, sub in properties.items()))
    raise SchemaProblem(f"field '{path}': unsupported schema {json.dumps(schema)[:120]} "
                        f"(typed columns take string, integer, number, boolean, date, "
                        f"date-time, arrays, objects, string enums, and null alongside one)")


def _without_null(schema: dict, path: str) -> dict:
    """`{"type": [X, "null"]}` or `{"anyOf": [X, {"type": "null"}]}` as X; else the schema."""
    kind = schema.get("type")
    if isinstance(kind, list):
        rest = [k for k in kind if k != "null"]
        if len(rest) != 1:
            raise SchemaProblem(f"field '{path}': one type (and null), not {kind}")
        return {**schema, "type": rest[0]}
    for word in ("anyOf", "oneOf"):
        if word in schema:
            rest = [s for s in schema[word] if s != {"type": "null"}]
            if len(rest) != 1:
                raise SchemaProblem(f"field '{path}': {word} of one schema (and null) only")
            return rest[0]
    return schema
