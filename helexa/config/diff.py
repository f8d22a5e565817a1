"""What changed between two configs of one schema, field by field, and how each change
takes effect (`reload` or `restart`, the field's own `apply` mark: config/fields.py).

`helexa deploy ship` compares a host's file with the rendered one by it to choose
`systemctl reload` or `restart`, and the router's reload names the fields that wait for a
restart by it (`config.restart_needed`): one reading of the schema's marks, so a field
marked restart is never taken for a reload-safe one by a list kept by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from helexa.config.fields import RESTART
from helexa.config.schema import _type_info, field_apply


@dataclass
class Change:
    key: str  # shown key: `models[Qwen/Qwen3-8B].tp`, `limits.schema_workers`
    before: Any
    after: Any
    apply: str  # RELOAD or RESTART


def changes(schema: type[msgspec.Struct], old: Any, new: Any) -> list[Change]:
    """The fields that differ between `old` and `new` (plain data, or configs of `schema`),
    by shown key."""
    info = _type_info(schema)  # (tens of ms each time: on the router's loop at a reload)
    if isinstance(old, msgspec.Struct):
        old = msgspec.to_builtins(old)
    if isinstance(new, msgspec.Struct):
        new = msgspec.to_builtins(new)
    before, after = leaves(old, info), leaves(new, info)
    out = []
    for key in sorted(before.keys() | after.keys()):
        (path, was), (path_after, now) = before.get(key, ("", None)), after.get(key, ("", None))
        if was == now:
            continue
        path = path or path_after
        try:
            apply = field_apply(schema, path) if path else RESTART
        except KeyError:  # a key the schema does not know (hand-edited on a host)
            apply = RESTART
        out.append(Change(key, was, now, apply))
    return out


def leaves(value: Any, t: Any, shown: str = "", path: str = "",
           out: dict[str, tuple[str, Any]] | None = None) -> dict[str, tuple[str, Any]]:
    """Flatten plain config data: shown key (`models[Qwen/Qwen3-8B].tp`) -> (schema key, value).

    The schema key (`models.tp`) is what `field_apply` takes; list items are
    named by their `id` or `name` so inserting a model does not shift the others.
    """
    out = {} if out is None else out
    t = _unwrap(t)
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        known = {f.encode_name: f.type for f in t.fields}
        for k, v in value.items():
            leaves(v, known.get(k), _join(shown, k), _join(path, k), out)
    elif isinstance(t, mi.ListType) and _is_struct(t.item_type) and isinstance(value, list):
        for i, item in enumerate(value):
            label = item.get("id", item.get("name", i)) if isinstance(item, dict) else i
            leaves(item, t.item_type, f"{shown}[{label}]", path, out)
    elif isinstance(t, mi.DictType) and _is_struct(t.value_type) and isinstance(value, dict):
        for k, v in value.items():
            leaves(v, t.value_type, _join(shown, k), path, out)
    else:
        out[shown] = (path, value)
    return out


def _unwrap(t: Any) -> Any:
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        arms = [a for a in t.types if not isinstance(a, mi.NoneType)]
        t = arms[0] if len(arms) == 1 else t
    return t


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _is_struct(t: Any) -> bool:
    return isinstance(_unwrap(t), mi.StructType)
