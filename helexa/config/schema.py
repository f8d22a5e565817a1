"""Typed configuration of the neuron, the router and the model catalogue: the schemas by
kind, and what every daemon does with a config file.

TOML is parsed once, at process entry, into frozen msgspec Structs, declared by
concern: neuron.py (server, admission, KV, engine, models, profiles), speculation.py
(the speculation keys and which apply to a model), router.py, catalogue.py, from the
field declarations of fields.py. This module names them for the daemons and for
docs/config.md (`SCHEMAS`; `helexa config doc`). Reading and validating a file is
load.py's: a bad file raises `ConfigError` with one line per error, `file: key: what
was expected`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import msgspec

from helexa.config.catalogue import CatalogueModel, ModelsCatalogue
from helexa.config.fields import RELOAD, RESTART, KvDtype, field_meta, optional

# The TOML reader and validation live in load.py; re-exported for the daemons.
from helexa.config.load import ConfigError, load_config, read_toml
from helexa.config.neuron import (
    AdmissionConfig,
    EngineConfig,
    KvConfig,
    ModelEntry,
    NeuronConfig,
    ProfileConfig,
    ServerConfig,
)
from helexa.config.router import (
    AuthConfig,
    LimitsConfig,
    NeuronEndpoint,
    NeuronsConfig,
    RouterConfig,
    RouterServerConfig,
    TimeoutsConfig,
)
from helexa.config.speculation import Speculation, parse_drafter, resolve_speculation

__all__ = [
    "RELOAD", "RESTART", "SCHEMAS", "AdmissionConfig", "AuthConfig", "CatalogueModel",
    "ConfigError", "EngineConfig", "KvConfig", "KvDtype", "LimitsConfig", "ModelEntry", "ModelsCatalogue",
    "NeuronConfig", "NeuronEndpoint", "NeuronsConfig", "ProfileConfig", "RouterConfig",
    "RouterServerConfig", "ServerConfig", "Speculation", "TimeoutsConfig", "detect_kind",
    "field_apply", "field_meta", "load_config", "load_neuron_config", "load_router_config",
    "optional", "parse_drafter", "read_secret", "read_toml", "resolve_path",
    "resolve_speculation", "to_plain",
]

# --------------------------------------------------------------------- loading

SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "neuron": NeuronConfig,
    "router": RouterConfig,
    "models": ModelsCatalogue,
}


def detect_kind(path: str | Path) -> str:
    """Which schema a file uses, from its location or its top-level keys."""
    p = Path(path)
    if p.name == "router.toml" or "router" in p.stem:
        return "router"
    if p.name == "models.toml":
        return "models"
    return "neuron"


def load_neuron_config(path: str | Path) -> NeuronConfig:
    return load_config(path, NeuronConfig)


def load_router_config(path: str | Path) -> RouterConfig:
    return load_config(path, RouterConfig)


def resolve_path(config_file: str | Path, value: str) -> Path:
    """A path from a config file, relative to the file's folder."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (Path(config_file).resolve().parent / p)


def read_secret(config_file: str | Path, value: str | None) -> str | None:
    """The stripped contents of a secret file named in a config (never logged)."""
    if value is None:
        return None
    return resolve_path(config_file, value).read_text().strip()


def to_plain(cfg: msgspec.Struct) -> dict[str, Any]:
    """The effective config as plain data (defaults filled, None dropped) for tomli-w."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(msgspec.to_builtins(cfg))


@functools.cache
def field_apply(schema: type[msgspec.Struct], dotted: str) -> str:
    """`reload` or `restart` for a dotted key such as `admission.max_in_flight`. Cached,
    as is the schema's type_info (tens of ms each): a SIGHUP asks for every field of the
    config on the neuron's event loop, which serves every stream meanwhile."""
    info = _type_info(schema)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        while isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.DictType)):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
        if not isinstance(info, msgspec.inspect.StructType):
            break
        field = next((f for f in info.fields if f.name == part), None)
        if field is None:
            raise KeyError(dotted)
        t = field.type
        if isinstance(t, msgspec.inspect.Metadata) and t.extra and "apply" in t.extra:
            if i == len(parts) - 1 or not _is_struct(t.type):
                return t.extra["apply"]
        info = t.type if isinstance(t, msgspec.inspect.Metadata) else t
        if isinstance(info, msgspec.inspect.UnionType):
            info = next((x for x in info.types if not isinstance(x, msgspec.inspect.NoneType)), info)
    return RESTART


_type_info = functools.cache(msgspec.inspect.type_info)


def _is_struct(t: Any) -> bool:
    return isinstance(t, msgspec.inspect.StructType)
