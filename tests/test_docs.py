"""The docs cannot drift from the code: the config reference is regenerated and
compared, every key it lists agrees with `field_apply`, and every example config
validates (and plans) as the daemons would load it."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from helexa import config
from helexa.config import (
    RELOAD,
    AdmissionConfig,
    ConfigError,
    NeuronConfig,
    detect_kind,
    field_apply,
    field_meta,
    load_config,
)
from helexa.config_doc import UndocumentedField, render_reference

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "config.md"
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.toml"))


def stale_diff(committed: str, rendered: str) -> str:
    """Empty when docs/config.md is what the schema renders, else the diff to apply."""
    return "".join(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                        "docs/config.md (committed)", "rendered from helexa/config.py"))


def test_config_reference_is_current() -> None:
    diff = stale_diff(REFERENCE.read_text(), render_reference())
    assert not diff, "docs/config.md is stale; run `helexa config doc -o docs/config.md`\n" + diff


class _AdmissionPlus(AdmissionConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_tokens_per_minute: Annotated[int, field_meta("Token rate cap per principal.", RELOAD, ge=1)] = 100


class _NeuronPlus(NeuronConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    admission: _AdmissionPlus = msgspec.field(default_factory=_AdmissionPlus)


def test_a_field_added_without_regenerating_is_caught(monkeypatch) -> None:
    monkeypatch.setitem(config.SCHEMAS, "neuron", _NeuronPlus)
    diff = stale_diff(REFERENCE.read_text(), render_reference())
    added = [line for line in diff.splitlines() if line.startswith("+|")]
    assert added == ["+| `admission.max_tokens_per_minute` | integer ≥ 1 | `100` | reload"
                     " | Token rate cap per principal. |"]


class _Undocumented(NeuronConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    secret_knob: int = 0


def test_a_field_without_doc_and_apply_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(config.SCHEMAS, "neuron", _Undocumented)
    with pytest.raises(UndocumentedField, match="`secret_knob`"):
        render_reference()


def _reference_rows() -> list[tuple[str, str, str]]:
    """(kind, dotted key, apply) of every row of docs/config.md."""
    rows, kind = [], ""
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("## "):
            kind = {"Neuron": "neuron", "Router": "router"}.get(line[3:].split(":")[0], "models")
        m = re.match(r"^\| `([^`]+)` \| .* \| (reload|restart) \| .* \|$", line)
        if m:
            rows.append((kind, m.group(1), m.group(2)))
    return rows


def test_reference_agrees_with_field_apply() -> None:
    # deploy decides reload vs restart with field_apply: the doc must say the same
    rows = _reference_rows()
    assert len(rows) > 50
    for kind, key, apply in rows:
        schema_path = key.replace("[]", "").replace(".<name>", "")
        assert field_apply(config.SCHEMAS[kind], schema_path) == apply, key
    keys = {key for _, key, _ in rows}
    assert {"admission.max_in_flight", "models[].tp", "profiles.<name>.kv_dtype",
            "neurons.endpoints[].address", "aliases"} <= keys


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load_and_plan(path: Path) -> None:
    kind = detect_kind(path)
    cfg = load_config(path, config.SCHEMAS[kind])
    if kind == "neuron":
        from helexa.plan import check_neuron_config
        plans = check_neuron_config(path, cfg)
        assert [p.model_id for p in plans] == [m.id for m in cfg.models]


def test_examples_cover_both_daemons() -> None:
    kinds = {detect_kind(p) for p in EXAMPLES}
    assert kinds == {"neuron", "router"}


def test_a_broken_example_would_be_caught(tmp_path: Path) -> None:
    bad = tmp_path / "neuron.toml"
    bad.write_text((ROOT / "docs/examples/neuron-cpu.toml").read_text()
                   .replace("max_slots = 4", "max_slot = 4"))
    with pytest.raises(ConfigError, match="engine.max_slot: unknown key"):
        load_config(bad, NeuronConfig)


# ------------------------------------------------------------- prose vs code

PROSE = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "operating.md"]
_TOP_KEYS = {f.name for schema in (config.NeuronConfig, config.RouterConfig)
             for f in msgspec.structs.fields(schema)}


def test_sample_output_in_operating_md_is_what_the_command_prints(monkeypatch, capsys) -> None:
    from helexa.plan import main as plan_main

    text = (ROOT / "docs" / "operating.md").read_text()
    m = re.search(r"<!-- output of: helexa plan (\S+) -->\n```\n(.*?)```", text, re.S)
    assert m, "operating.md lost its `helexa plan` sample"
    monkeypatch.chdir(ROOT)
    assert plan_main([m.group(1)]) == 0
    assert capsys.readouterr().out == m.group(2), (
        f"docs/operating.md: the `helexa plan {m.group(1)}` sample is stale; paste the new output")


def test_config_keys_named_in_the_docs_exist() -> None:
    named = set()
    for doc in PROSE:
        for key in re.findall(r"`([a-z_]+(?:\[\])?(?:\.(?:<name>|[a-z_]+)(?:\[\])?)+)`", doc.read_text()):
            if key.split(".")[0].removesuffix("[]") in _TOP_KEYS:
                named.add((doc.name, key))
    assert len(named) > 20
    for doc, key in sorted(named):
        path = key.replace("[]", "").replace(".<name>", "")
        found = []
        for schema in (config.NeuronConfig, config.RouterConfig):
            try:
                field_apply(schema, path)
                found.append(schema)
            except KeyError:
                pass
        assert found, f"docs/{doc} names `{key}`, which no config schema has"


def _source_metric_patterns() -> list[re.Pattern[str]]:
    patterns = []
    for folder in ("neuron", "router"):
        for py in (ROOT / folder).rglob("*.py"):
            for lit in re.findall(r"\"(helexa_[a-z_{}]+)\"", py.read_text()):
                patterns.append(re.compile(re.sub(r"\\\{[a-z_]*\\\}", "[a-z_]+", re.escape(lit)) + "$"))
    return patterns


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([a-z_,]+)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def test_metric_names_in_the_docs_exist_in_the_code() -> None:
    patterns = _source_metric_patterns()
    names = {n for doc in PROSE
             for raw in re.findall(r"`(helexa_[a-z_{},]+)`", doc.read_text()) for n in _expand(raw)}
    assert len(names) > 20
    for name in sorted(names):
        base = name.removesuffix("_total")  # prometheus_client adds _total to counters
        assert any(p.match(name) or p.match(base) for p in patterns), \
            f"the docs name metric `{name}`, which neither neuron/ nor router/ defines"


def test_commands_named_in_the_docs_exist() -> None:
    from helexa.cli import COMMANDS

    for doc in PROSE:
        for cmd in re.findall(r"(?<![\w/.-])helexa ([a-z]+)\b", doc.read_text()):
            if cmd not in {"serves"}:  # prose, not a command
                assert cmd in COMMANDS, f"docs/{doc.name} names `helexa {cmd}`"
