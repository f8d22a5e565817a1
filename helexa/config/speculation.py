"""Speculative decoding's settings: one typed struct, one parser, one resolver.

`Speculation` is the six speculation keys (docs/speculation.md): the drafter
(`speculation`) and how its drafts adapt to load (`spec_k` and four thresholds).
It is declared once, here. [engine] takes its keys from it (EngineConfig is a
Speculation, so docs/config.md documents them from these declarations), and the
engine runs under it (helexa/neuron/engine/messages.py: Limits is a Speculation).
The per-model and per-profile keys only override it.

`resolve_speculation(engine, entry, profile)` is the one answer to "which
speculation applies to this model": each key from the nearest place that sets
it, the profile the model runs, else its [[models]] entry, else [engine]. The
engine loads with it, `helexa plan` sizes the pool with it, a reload and a
profile switch apply it.

`parse_drafter` is the one reader of a drafter setting ("ngram", "mtp", "off" or
"draft:<model id>"): the config, `helexa up --speculation` and every Speculation
made (its __post_init__) go through it, so a name means the same thing wherever
it is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from helexa.config.fields import RELOAD, field_meta

if TYPE_CHECKING:
    from helexa.config.neuron import ModelEntry, ProfileConfig

Method = Literal["off", "ngram", "mtp", "draft"]
DRAFT_PREFIX = "draft:"
BUILT_IN: tuple[Method, ...] = ("ngram", "mtp", "off")  # the drafters that need no model id


def parse_drafter(value: str, where: str = "speculation", *,
                  per_model: bool = True) -> tuple[Method, str]:
    """(method, draft model id or "") of a drafter setting; ValueError naming `where` and
    what was expected otherwise. `per_model` False refuses "draft:<id>": a draft model
    belongs to one target, which loads it with itself, so only a [[models]] entry names one."""
    for method in BUILT_IN:
        if value == method:
            return method, ""
    if value.startswith(DRAFT_PREFIX):
        draft = value[len(DRAFT_PREFIX):]
        if not per_model:
            raise ValueError(f"{where}: {value!r}: a draft model is set per model, in that "
                             "model's [[models]] speculation (docs/speculation.md)")
        if not draft:
            raise ValueError(f"{where}: expected \"draft:<model id>\" naming a [[models]] "
                             f"entry, got {value!r}")
        return "draft", draft
    raise ValueError(f"{where}: expected \"ngram\", \"mtp\", \"draft:<model id>\" or"
                     f" \"off\", got {value!r}")


class Speculation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which drafter a model runs and how hard it drafts. The field docs are [engine]'s
    keys (docs/config.md); `resolve_speculation` gives one model's."""

    speculation: Annotated[str, field_meta(
        "Speculative decoding drafter of every model: ngram (prompt lookup), mtp (the"
        " checkpoint's multi-token-prediction head) or off (docs/speculation.md); a draft"
        " model is set per model (models[].speculation).", RELOAD)] = "off"
    spec_k: Annotated[int, field_meta(
        "Most tokens drafted per request per step.", RELOAD, ge=0, le=16)] = 4
    spec_full_below: Annotated[float, field_meta(
        "Speculate with spec_k while running requests / max_slots is at most this.",
        RELOAD, ge=0, le=1)] = 0.25
    spec_off_above: Annotated[float, field_meta(
        "No speculation once running requests / max_slots reaches this (between the two, k"
        " shrinks linearly).", RELOAD, ge=0, le=1.01)] = 0.75
    spec_min_acceptance: Annotated[float, field_meta(
        "A request whose recent acceptance rate is below this drafts only an occasional probe.",
        RELOAD, ge=0, le=1)] = 0.3
    spec_keep_acceptance: Annotated[float, field_meta(
        "A request whose recent acceptance rate is at least this drafts spec_k at any load"
        " (above 1: never).", RELOAD, ge=0)] = 0.8

    def __post_init__(self) -> None:
        parse_drafter(self.speculation)

    @property
    def method(self) -> Method:
        """off, ngram, mtp or draft (a draft model: `draft_model`)."""
        return parse_drafter(self.speculation)[0]

    @property
    def draft_model(self) -> str:
        """The [[models]] id of the draft checkpoint ("" unless method is draft)."""
        return parse_drafter(self.speculation)[1]

    @property
    def drafts(self) -> bool:
        """Whether any token is ever drafted: a drafter is named and spec_k > 0."""
        return self.speculation != "off" and self.spec_k > 0


def resolve_speculation(engine: Speculation, entry: ModelEntry | None = None,
                        profile: ProfileConfig | None = None) -> Speculation:
    """The speculation one model runs: each key from its profile where that sets it, else
    from its [[models]] entry, else from [engine] (docs/speculation.md, "Configuration")."""
    keys = Speculation.__struct_fields__
    values = {key: getattr(engine, key) for key in keys}
    for over in (entry, profile):
        if over is not None:
            given = msgspec.structs.asdict(over)
            values.update({key: given[key] for key in keys if given.get(key) is not None})
    return Speculation(**values)
