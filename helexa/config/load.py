"""Reading and validating config files: TOML in, a typed struct or every error out.

`read_toml` turns a file into plain data (ConfigError for a missing,
unreadable, non-UTF-8 or malformed file). `load_config` converts it into a
schema of helexa/config/schema.py; when that fails, `config_errors` walks the file
table by table and key by key, so the ConfigError lists every error of the
file, one line each: `file: key: what was expected` (msgspec alone stops at
the first, and an operator would fix three typos in three runs).
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(Exception):
    """A config file that cannot be used; str() is one `file: key: expected` line per error."""

    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines = list(lines)


_PRIMITIVES: dict[type, type] = {msgspec.inspect.StrType: str, msgspec.inspect.IntType: int,
               msgspec.inspect.FloatType: float, msgspec.inspect.BoolType: bool}


# `key: what is wrong` as a __post_init__ raises it; a key is dotted, a segment quoted where
# TOML quotes it (aliases."helexa/balanced")
_OWN = re.compile(r'^([A-Za-z_][\w\[\]]*(?:\.(?:[\w\[\]-]+|"(?:[^"\\]|\\.)*"))*): (.*)$')


def _unwrap(info: Any) -> Any:
    """Strip Metadata and the None arm of an optional type."""
    while True:
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        elif isinstance(info, msgspec.inspect.UnionType):
            rest = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(rest) != 1:
                return info
            info = rest[0]
        else:
            return info


def _locate(raw: Any, schema: type, where: str) -> tuple[str, Any]:
    """Name the table keys msgspec shows as `[...]`, and return the type at `where`.

    msgspec reports an error inside a dict as `profiles[...]`; walking the raw
    data finds the entry that fails, so the message says `profiles.batch`.
    """
    info: Any = msgspec.inspect.type_info(schema)
    node: Any = raw
    out: list[str] = []
    for name, index in re.findall(r"\.?([A-Za-z_]\w*)|\[(\d+|\.\.\.)\]", where):
        info = _unwrap(info)
        if name:
            out.append(f".{name}" if out else name)
            field = next((f for f in getattr(info, "fields", ()) if f.name == name), None)
            info = field.type if field else None
            node = node.get(name) if isinstance(node, dict) else None
        elif index == "...":
            value_type = info.value_type if isinstance(info, msgspec.inspect.DictType) else None
            key = _failing_key(node, _unwrap(value_type))
            out.append(f".{key}" if key is not None else "[...]")
            node = node.get(key) if isinstance(node, dict) and key is not None else None
            info = value_type
        else:
            out.append(f"[{index}]")
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else None
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
    return "".join(out), _unwrap(info)


def _failing_key(table: Any, value_type: Any) -> str | None:
    """The first key of `table` whose value does not convert to `value_type`."""
    if not isinstance(table, dict):
        return None
    target = getattr(value_type, "cls", None) or _PRIMITIVES.get(type(value_type))
    if target is None:
        return None
    for key, value in table.items():
        try:
            msgspec.convert(value, target, strict=True)
        except (msgspec.ValidationError, TypeError, ValueError):
            return str(key)
    return None


def _format_error(path: Path, err: msgspec.ValidationError, raw: Any = None,
                  schema: type | None = None) -> str:
    """`Expected `int`, got `str` - at `$.a.b`` → `file: a.b: expected int, got str`."""
    msg = str(err)
    where = ""
    if " - at `$" in msg:
        msg, _, where = msg.rpartition(" - at `$")
        where = where.rstrip("`").lstrip(".")
    info = None
    if schema is not None:
        where, info = _locate(raw, schema, where)
    if msg.startswith("Invalid enum value ") and isinstance(info, msgspec.inspect.LiteralType):
        choices = ", ".join(str(v) for v in info.values)
        msg = f"expected one of {choices}, got {msg.removeprefix('Invalid enum value ')}"
    msg = msg.replace("`", "").replace(" | null", "")  # TOML has no null: an unset key is None
    own = _OWN.match(msg)  # raised by a __post_init__
    if own:
        where = f"{where}.{own.group(1)}" if where else own.group(1)
        msg = own.group(2)
    if msg.startswith("Object contains unknown field "):
        key = msg.removeprefix("Object contains unknown field ")
        where = f"{where}.{key}" if where else key
        msg = "unknown key (check the spelling; see docs/config.md)"
    elif msg.startswith("Object missing required field "):
        key = msg.removeprefix("Object missing required field ")
        where = f"{where}.{key}" if where else key
        msg = "missing required key"
    else:
        msg = msg[0].lower() + msg[1:] if msg else msg
    return f"{path}: {where or '(top level)'}: {msg}"


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as plain data; ConfigError (`file: (syntax): …`) when it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: (file): no such file") from None
    except OSError as e:
        raise ConfigError(f"{path}: (file): cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 by definition
        line = Path(path).read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: (file): not UTF-8 (byte 0x{e.object[e.start]:02x} on line"
                          f" {line}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: (syntax): {e}") from None


def load_config(path: str | Path, schema: type[T]) -> T:
    """Parse and validate one TOML file; raises ConfigError listing every error, one a line."""
    path = Path(path)
    raw = read_toml(path)
    try:
        return msgspec.convert(raw, schema, strict=True)
    except msgspec.ValidationError as e:
        lines = config_errors(path, raw, schema) or [_format_error(path, e, raw, schema)]
        raise ConfigError(*lines) from None


def config_errors(path: Path, raw: Any, schema: type[msgspec.Struct]) -> list[str]:
    """Every error of `raw` against `schema`, one line each, in file order."""
    return _struct_errors(path, raw, schema, "")


def _struct_errors(path: Path, raw: Any, schema: type[msgspec.Struct], where: str) -> list[str]:
    if not isinstance(raw, dict):
        return _value_errors(path, raw, schema, where)
    hints = typing.get_type_hints(schema, include_extras=True)
    info: Any = msgspec.inspect.type_info(schema)
    fields = {f.name: f for f in info.fields}
    out: list[str] = []
    for key, value in raw.items():
        at = f"{where}.{key}" if where else key
        if key not in fields:
            out.append(f"{path}: {at}: unknown key (check the spelling; see docs/config.md)")
            continue
        out += _field_errors(path, value, hints[key], at)
    for name, f in fields.items():
        if f.required and name not in raw:
            out.append(f"{path}: {where + '.' if where else ''}{name}: missing required key")
    if not out:  # every key is right alone: what is left is a rule between keys
        out = _value_errors(path, raw, schema, where)
    return out


def _field_errors(path: Path, value: Any, tp: Any, where: str) -> list[str]:
    """Errors of one key's value: tables of structs are walked, anything else converted."""
    inner = _strip(tp)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
        return _struct_errors(path, value, inner, where)
    if origin is list and args and _is_struct(args[0]) and isinstance(value, list):
        return [e for i, item in enumerate(value)
                for e in _struct_errors(path, item, args[0], f"{where}[{i}]")]
    if origin is dict and len(args) == 2 and _is_struct(args[1]) and isinstance(value, dict):
        return [e for k, item in value.items()
                for e in _struct_errors(path, item, args[1], f"{where}.{k}")]
    return _value_errors(path, value, tp, where)


def _value_errors(path: Path, value: Any, tp: Any, where: str) -> list[str]:
    try:
        msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError as e:
        line = _format_error(path, e, value, tp)
        file_, _, rest = line.partition(": ")
        key, _, msg = rest.partition(": ")
        if key == "(top level)":
            key = where or key
        elif where:
            key = f"{where}{key}" if key.startswith("[") else f"{where}.{key}"
        return [f"{file_}: {key}: {msg}"]
    return []


def _strip(tp: Any) -> Any:
    """`Annotated[X, ...]` and `X | None` as X."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if type(None) in args:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)
