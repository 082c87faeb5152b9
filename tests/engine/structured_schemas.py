"""Twenty JSON schemas for structured-output tests, and a small validator for the keywords they use.

`SCHEMAS` covers what llguidance supports and a model is likely to be asked for: nested objects,
arrays with min/maxItems, enums and consts, bounded integers and numbers, booleans and nulls,
required and optional properties, string patterns, lengths and formats, anyOf, $defs/$ref (also
recursive), prefixItems and maps. `check(value, schema)` lists how a value breaks a schema, for
exactly the keywords used here (jsonschema is not a declared test dependency); formats are checked
too, which jsonschema skips unless asked.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

_POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}

SCHEMAS: list[dict[str, Any]] = [
    {  # 0: flat object, string lengths, bounded integer, no extra keys
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # 1: booleans, null, nullable string; extra keys allowed (JSON Schema default)
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "deleted": {"type": "null"},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["active", "deleted", "note"],
    },
    {"type": "string", "enum": ["red", "green", "blue"]},  # 2: top-level enum
    {  # 3: array of bounded integers with min/maxItems
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # 4: nested object with a string pattern
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 30},
                    "city": {"type": "string", "minLength": 1, "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            }
        },
        "required": ["address"],
        "additionalProperties": False,
    },
    {  # 5: numbers with inclusive and exclusive bounds
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "exclusiveMaximum": 1000},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "delta": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.5},
        },
        "required": ["price", "ratio", "delta"],
        "additionalProperties": False,
    },
    {"type": "integer", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 5},  # 6
    {  # 7: anyOf of two scalar types
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "string", "maxLength": 8},
                    {"type": "integer", "minimum": 0, "maximum": 9999},
                ]
            }
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    {  # 8: $defs and $ref
        "$defs": {"point": _POINT},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    {  # 9: recursive $ref (a tree)
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 99},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["value"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    {  # 10: array of objects with a pattern
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    {  # 11: optional properties
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 15},
            "subtitle": {"type": "string", "maxLength": 15},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {  # 12: string formats date and uuid
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day", "id"],
        "additionalProperties": {"type": "string", "format": "uuid"},
    },
    {  # 13: string formats email and ipv4
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "ip": {"type": "string", "format": "ipv4"},
        },
        "required": ["email", "ip"],
        "additionalProperties": False,
    },
    {  # 14: const and an enum of mixed types
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "kind": {"const": "event"},
            "level": {"enum": [1, "two", None, True]},
        },
        "required": ["version", "kind", "level"],
        "additionalProperties": False,
    },
    {  # 15: tuple through prefixItems
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 10},
            {"type": "integer"},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    {  # 16: a map with min/maxProperties
        "type": "object",
        "additionalProperties": {"type": "number", "minimum": -10, "maximum": 10},
        "minProperties": 1,
        "maxProperties": 3,
    },
    {  # 17: deep nesting
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
                        },
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {  # 18: type lists
        "type": "object",
        "properties": {
            "code": {"type": ["integer", "null"]},
            "label": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["code", "label"],
        "additionalProperties": False,
    },
    {  # 19: a discriminated union of objects
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "shape": {"const": "circle"},
                    "r": {"type": "number", "minimum": 0, "maximum": 10},
                },
                "required": ["shape", "r"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "shape": {"const": "rect"},
                    "w": {"type": "integer", "minimum": 1, "maximum": 9},
                    "h": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["shape", "w", "h"],
                "additionalProperties": False,
            },
        ]
    },
]


# -- the validator ---------------------------------------------------------------------------------

# RFC 5321 Mailbox: a dot-string local part, then a domain or an IPv4 literal.
_ATOM = r"[A-Za-z0-9!#$%&'*+\-/=?^_`{|}~]+"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_EMAIL = re.compile(rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9.]+\])")
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _format_ok(fmt: str, s: str) -> bool:
    """RFC 3339 full-date (February 29 in any year, as llguidance allows), RFC 4122 uuid,
    dotted-quad ipv4, RFC 5321 email."""
    if fmt == "date":
        m = re.fullmatch(r"[0-9]{4}-([0-9]{2})-([0-9]{2})", s)
        return (
            m is not None and 1 <= int(m[1]) <= 12 and 1 <= int(m[2]) <= _MONTH_DAYS[int(m[1]) - 1]
        )
    if fmt == "uuid":
        return re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", s) is not None
    if fmt == "ipv4":
        try:
            return re.fullmatch(r"[0-9.]+", s) is not None and bool(ipaddress.IPv4Address(s))
        except ValueError:
            return False
    if fmt == "email":
        m = _EMAIL.fullmatch(s)
        if m is None:
            return False
        host = s.rsplit("@", 1)[1]
        return not host.startswith("[") or _format_ok("ipv4", host[1:-1])
    raise ValueError(f"format {fmt!r} is not checked by this validator")


_PY_TYPES = (
    ("string", str),
    ("boolean", bool),
    ("null", type(None)),
    ("object", dict),
    ("array", list),
)


def _type_ok(t: str, v: Any) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, int | float) and not isinstance(v, bool)
    return isinstance(v, dict(_PY_TYPES)[t])


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def check(value: Any, schema: Any, root: Any = None, path: str = "$") -> list[str]:
    """How `value` breaks `schema` (empty: it validates)."""
    root = schema if root is None else root
    if schema is True:
        return []
    if schema is False:
        return [f"{path}: no value is allowed here"]
    errs: list[str] = []
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/"):
            if part:
                target = target[part]
        errs += check(value, target, root, path)
    if "anyOf" in schema and all(check(value, s, root, path) for s in schema["anyOf"]):
        errs.append(f"{path}: matches no anyOf branch")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(t, value) for t in types):
            return [*errs, f"{path}: {value!r} is not of type {types}"]
    if "const" in schema and not _same(value, schema["const"]):
        errs.append(f"{path}: {value!r} != const {schema['const']!r}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        errs.append(f"{path}: {value!r} not in enum")
    if isinstance(value, int | float) and not isinstance(value, bool):
        errs += _check_number(value, schema, path)
    if isinstance(value, str):
        errs += _check_string(value, schema, path)
    if isinstance(value, list):
        errs += _check_array(value, schema, root, path)
    if isinstance(value, dict):
        errs += _check_object(value, schema, root, path)
    return errs


def _check_number(v: float, schema: dict, path: str) -> list[str]:
    errs = []
    if "minimum" in schema and not v >= schema["minimum"]:
        errs.append(f"{path}: {v} < minimum")
    if "maximum" in schema and not v <= schema["maximum"]:
        errs.append(f"{path}: {v} > maximum")
    if "exclusiveMinimum" in schema and not v > schema["exclusiveMinimum"]:
        errs.append(f"{path}: {v} <= exclusiveMinimum")
    if "exclusiveMaximum" in schema and not v < schema["exclusiveMaximum"]:
        errs.append(f"{path}: {v} >= exclusiveMaximum")
    if "multipleOf" in schema and not math.isclose(v / schema["multipleOf"] % 1, 0, abs_tol=1e-9):
        errs.append(f"{path}: {v} is not a multiple of {schema['multipleOf']}")
    return errs


def _check_string(v: str, schema: dict, path: str) -> list[str]:
    errs = []
    if len(v) < schema.get("minLength", 0) or len(v) > schema.get("maxLength", math.inf):
        errs.append(f"{path}: length {len(v)} outside [minLength, maxLength]")
    if "pattern" in schema and re.search(schema["pattern"], v) is None:
        errs.append(f"{path}: {v!r} does not match {schema['pattern']!r}")
    if "format" in schema and not _format_ok(schema["format"], v):
        errs.append(f"{path}: {v!r} is not a valid {schema['format']}")
    return errs


def _check_array(v: list, schema: dict, root: Any, path: str) -> list[str]:
    errs = []
    if len(v) < schema.get("minItems", 0) or len(v) > schema.get("maxItems", math.inf):
        errs.append(f"{path}: {len(v)} items outside [minItems, maxItems]")
    prefix = schema.get("prefixItems", [])
    for i, item in enumerate(v):
        sub = prefix[i] if i < len(prefix) else schema.get("items", True)
        errs += check(item, sub, root, f"{path}[{i}]")
    return errs


def _check_object(v: dict, schema: dict, root: Any, path: str) -> list[str]:
    errs = []
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in v:
            errs.append(f"{path}: missing required {key!r}")
    n = len(v)
    if n < schema.get("minProperties", 0) or n > schema.get("maxProperties", math.inf):
        errs.append(f"{path}: {n} properties outside [minProperties, maxProperties]")
    for key, item in v.items():
        sub = props[key] if key in props else schema.get("additionalProperties", True)
        errs += check(item, sub, root, f"{path}.{key}")
    return errs
