"""Where helexa/plan.py reads a model's numbers besides its own shape: the config.json an
entry names, and a draft model's costs on its target's card; and the errors a plan
raises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helexa.checkpoint.memory import kv_bytes_per_token, weight_bytes_per_card
from helexa.checkpoint.shape import read_model_shape
from helexa.config.schema import ConfigError, ModelEntry, NeuronConfig, resolve_path


class PlanError(ConfigError):
    """A model that cannot be planned as configured; the message shows the arithmetic."""


class UnknownBudget(PlanError):
    """Neither a KV budget nor the device memory is known (a live device can tell)."""


def model_config_path(config_file: str | Path, entry: ModelEntry) -> Path:
    """The config.json used to plan an entry: `config`, else `path`/config.json."""
    if entry.config is not None:
        return resolve_path(config_file, entry.config)
    assert entry.path is not None  # ModelEntry guarantees one of them
    return resolve_path(config_file, entry.path) / "config.json"


def draft_costs(cfg: NeuronConfig, config_file: str | Path, draft_id: str, kv_dtype: str,
                weight_dtype: str, where: Any) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of a draft model run in the target's weight and KV
    dtypes, unsharded (docs/speculation.md)."""
    try:
        d = cfg.model(draft_id)
    except KeyError:
        raise PlanError(f"{where('speculation')}: no [[models]] entry `{draft_id}`") from None
    d_path = model_config_path(config_file, d)
    try:
        d_shape = read_model_shape(json.loads(d_path.read_text()))
    except FileNotFoundError:
        raise PlanError(f"{where('speculation')}: draft model `{draft_id}`: expected a model "
                        f"config.json, no file {d_path}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise PlanError(f"{where('speculation')}: draft model `{draft_id}`: {d_path}: "
                        f"unreadable model config ({e!r})") from None
    return (weight_bytes_per_card(d_shape, 1, weight_dtype),
            kv_bytes_per_token(d_shape, 1, kv_dtype))
