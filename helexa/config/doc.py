"""The config reference (docs/config.md), generated from the schemas in helexa/config/schema.py
(declared in neuron.py, speculation.py, router.py, catalogue.py).

Every key of every schema in `helexa.config.schema.SCHEMAS` becomes one row: its
dotted name (`admission.max_in_flight`, `models[].tp`,
`profiles.<name>.kv_dtype`), type with its bounds, default, whether a running
daemon applies it on SIGHUP (`reload`) or only at start (`restart`), and its
meaning — the `msgspec.Meta` description given by `field_meta`. The schema is
the single source: `helexa config doc -o docs/config.md` rewrites the file and
tests/test_docs.py fails when the committed file differs from what this renders.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import tomli_w

from helexa.config import schema as config

# Where each kind of file lives, for the section headings.
FILES = {
    "neuron": ("Neuron", "asset/neuron/<host>.toml", "helexa-neuron"),
    "router": ("Router", "asset/router.toml", "helexa-router"),
    "models": ("Model catalogue", "asset/models.toml", None),
}

HEADER = """\
# Config reference

Generated from the schemas in `helexa/config/schema.py` by `helexa config doc -o docs/config.md`.
Do not edit by hand: `tests/test_docs.py` fails when this file and the schemas disagree.

Each key is a dotted path: `admission.max_in_flight` is `max_in_flight` in the
`[admission]` table, `models[].tp` is `tp` in each `[[models]]` table, and
`profiles.<name>.kv_dtype` is `kv_dtype` in a `[profiles.<name>]` table.
An unknown key or a wrong type is an error naming the file, the key and what was
expected; `helexa config check FILE…` lists every error of a file, one line each. Secrets are never inline: a `*_file` key
names a file whose contents are read by the daemon alone.

**apply**: `reload` — a running daemon takes the new value on SIGHUP
(`systemctl reload helexa-neuron`, or `helexa deploy ship`, which reloads when it can);
`restart` — read once at start (`systemctl restart …`).
"""


class UndocumentedField(ValueError):
    """A schema field declared without `field_meta(doc, apply)`."""


def _bounds(t: Any) -> str:
    marks = [(getattr(t, "ge", None), "≥"), (getattr(t, "gt", None), ">"),
             (getattr(t, "le", None), "≤"), (getattr(t, "lt", None), "<")]
    return ", ".join(f"{sym} {v}" for v, sym in marks if v is not None)


def type_name(t: Any) -> str:
    """A short human name of a msgspec.inspect type: `integer ≥ 1`, `list of string`."""
    if isinstance(t, mi.Metadata):
        return type_name(t.type)
    if isinstance(t, mi.UnionType):
        arms = [a for a in t.types if not isinstance(a, mi.NoneType)]
        return " or ".join(type_name(a) for a in arms)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(f"`{v}`" for v in t.values)
    simple = {mi.StrType: "string", mi.IntType: "integer", mi.FloatType: "number",
              mi.BoolType: "boolean"}
    for cls, name in simple.items():
        if isinstance(t, cls):
            b = _bounds(t)
            return f"{name} {b}" if b else name
    if isinstance(t, mi.ListType):
        return f"list of {type_name(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"table of {type_name(t.key_type)} → {type_name(t.value_type)}"
    if isinstance(t, mi.StructType):
        return "table"
    return type(t).__name__


def default_text(f: mi.Field) -> str:
    if f.required:
        return "required"
    value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    if value is None:
        return "unset"
    return f"`{_inline(msgspec.to_builtins(value))}`"


def _inline(v: Any) -> str:
    """A value as inline TOML (tomli-w alone would split arrays over lines)."""
    if isinstance(v, list):
        return "[" + ", ".join(_inline(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_inline(x)}" for k, x in v.items()) + "}"
    return tomli_w.dumps({"v": v}).split(" = ", 1)[1].strip()


def _literal_values(cls: type, name: str) -> tuple[Any, ...] | None:
    """A Literal's values in declaration order (msgspec.inspect sorts them)."""
    def find(tp: Any) -> tuple[Any, ...] | None:
        if typing.get_origin(tp) is typing.Literal:
            return typing.get_args(tp)
        for arg in typing.get_args(tp):
            found = find(arg)
            if found:
                return found
        return None
    return find(typing.get_type_hints(cls, include_extras=True).get(name))


def _struct_of(t: Any) -> tuple[mi.StructType | None, str]:
    """The struct a field holds (directly, or as list items / table values) and the key suffix."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        arms = [a for a in t.types if not isinstance(a, mi.NoneType)]
        t = arms[0] if len(arms) == 1 else t
    if isinstance(t, mi.StructType):
        return t, ""
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
        return t.item_type, "[]"
    if isinstance(t, mi.DictType) and isinstance(t.value_type, mi.StructType):
        return t.value_type, ".<name>"
    return None, ""


def _own_keys_first(struct: mi.StructType) -> list[mi.Field]:
    """A table's own keys, then those it takes from a struct it extends ([engine]'s
    speculation keys are helexa/config/speculation.py's Speculation), so a key shared that
    way keeps its place in the reference."""
    inherited = {name for base in struct.cls.__mro__[1:] if issubclass(base, msgspec.Struct)
                 for name in base.__struct_fields__}
    return ([f for f in struct.fields if f.name not in inherited]
            + [f for f in struct.fields if f.name in inherited])


def _rows(struct: mi.StructType, prefix: str, owner: str,
          sections: list[tuple[str, list[str]]]) -> list[str]:
    """Table rows of one struct's plain keys; nested tables become further sections."""
    rows = []
    for f in _own_keys_first(struct):
        key = prefix + f.encode_name
        inner, suffix = _struct_of(f.type)
        meta = f.type if isinstance(f.type, mi.Metadata) else None
        if inner is not None and meta is None:
            _section(inner, key + suffix, owner, sections)
            continue
        if meta is None or not (meta.extra or {}).get("apply") \
                or not (meta.extra_json_schema or {}).get("description"):
            raise UndocumentedField(f"{owner}: `{key}` is declared without field_meta(doc, apply)"
                                    " in helexa/config/")
        doc = meta.extra_json_schema["description"].replace("|", "\\|")  # | ends a cell
        kind = type_name(f.type)
        order = _literal_values(struct.cls, f.name) if "one of" in kind else None
        if order:
            kind = "one of " + ", ".join(f"`{v}`" for v in order)
        kind = kind.replace("|", "\\|")
        rows.append(f"| `{key}` | {kind} | {default_text(f)} | {meta.extra['apply']} | {doc} |")
        if inner is not None:  # a documented list of tables: its own keys follow
            _section(inner, key + suffix, owner, sections)
    return rows


def _section(struct: mi.StructType, key: str, owner: str,
             sections: list[tuple[str, list[str]]]) -> None:
    title = f"`[[{key[:-2]}]]`" if key.endswith("[]") else f"`[{key}]`"
    slot: list[str] = []
    sections.append((title, slot))  # reserve the place first so sections keep schema order
    slot += _rows(struct, key + ".", owner, sections)


def render_schema(kind: str, schema: type[msgspec.Struct]) -> str:
    name, where, unit = FILES.get(kind, (kind.title(), f"{kind}.toml", None))
    sections: list[tuple[str, list[str]]] = []
    top = _rows(mi.type_info(schema), "", schema.__name__, sections)
    out = [f"## {name}: `{where}`", ""]
    out.append(f"Schema `{schema.__name__}`." + (f" Daemon unit `{unit}`." if unit else ""))
    if top:
        sections.insert(0, ("top level", top))
    for title, rows in sections:
        if not rows:
            continue
        out += ["", f"### {title}", "", "| key | type | default | apply | meaning |",
                "|---|---|---|---|---|", *rows]
    return "\n".join(out) + "\n"


def render_reference(schemas: dict[str, type[msgspec.Struct]] | None = None) -> str:
    """The whole of docs/config.md (reads `helexa.config.schema.SCHEMAS` at call time)."""
    schemas = config.SCHEMAS if schemas is None else schemas
    parts = [HEADER] + [render_schema(kind, s) for kind, s in schemas.items()]
    return "\n".join(parts)
