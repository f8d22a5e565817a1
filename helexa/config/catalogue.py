"""The model catalogue (asset/models.toml): the models a fleet may serve, each with the
config.json that plans it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from helexa.config.fields import RELOAD, field_meta


class CatalogueModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, field_meta("Model id.", RELOAD)]
    config: Annotated[str, field_meta("Path of its config.json (relative to the catalogue file).", RELOAD)]
    description: Annotated[str, field_meta("What it is and why it is here.", RELOAD)] = ""
    weights_gb: Annotated[float | None, field_meta("Size of the weights on disk, for reference.", RELOAD)] = None
    quantize: Annotated[Literal["none", "int8", "int4"], field_meta(
        "How a neuron serves it: quantised at load as models[].quantize; weights_gb is then "
        "what it holds.", RELOAD)] = "none"


class ModelsCatalogue(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    models: list[CatalogueModel] = msgspec.field(default_factory=list)

