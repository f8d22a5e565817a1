"""Config files: the shipped assets pass, and each bad file gets one clear line and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helexa.cli import main as helexa_main
from helexa.config.schema import ModelsCatalogue, load_config, resolve_path
from helexa.fixtures.tiny import init_tiny

ASSET = Path(__file__).resolve().parent.parent / "asset"
NEURONS = sorted((ASSET / "neuron").glob("*.toml"))


def check(path: Path, capsys) -> tuple[int, list[str]]:
    rc = helexa_main(["config", "check", str(path)])
    err = capsys.readouterr().err
    return rc, err.splitlines()


def test_every_shipped_config_checks(capsys):
    files = [*NEURONS, ASSET / "router.toml", ASSET / "models.toml"]
    assert {p.stem for p in NEURONS} >= {"beast", "benjy", "local"}
    assert helexa_main(["config", "check", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == len(files)


@pytest.mark.parametrize("path", NEURONS, ids=lambda p: p.stem)
def test_plan_works_on_every_shipped_neuron_config(path, capsys):
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "KV per token/card" in out and "sessions  tokens each" in out


def test_catalogue_configs_exist():
    cat_file = ASSET / "models.toml"
    for m in load_config(cat_file, ModelsCatalogue).models:
        cfg = json.loads(resolve_path(cat_file, m.config).read_text())
        assert cfg["architectures"], m.id


def test_committed_tiny_config_is_what_init_tiny_writes(tmp_path):
    # local.toml plans from the committed config.json; `helexa up` writes
    # the weights with init-tiny defaults, which must give the same config.
    made = json.loads((init_tiny(tmp_path / "t") / "config.json").read_text())
    committed = json.loads((ASSET / "models" / "helexa" / "tiny-qwen3" / "config.json").read_text())
    assert made == committed


BAD = {
    "unknown key": ("[kv]\nblok_size = 16\n", "kv.blok_size", "unknown key"),
    "wrong type": ('[kv]\nblock_size = "16"\n', "kv.block_size", "expected int, got str"),
    "missing field": ('[[models]]\npath = "m"\n', "models[0].id", "missing required key"),
    "zero slots": ("[engine]\nmax_slots = 0\n", "engine.max_slots", "expected int >= 1"),
    "negative wait": ("[admission]\nkv_max_wait_secs = -1.0\n", "admission.kv_max_wait_secs",
                      "expected float >= 0"),
    "block size": ("[kv]\nblock_size = 24\n", "kv.block_size", "expected a power of two"),
    "bad enum": ('[kv]\nkv_dtype = "fp7"\n', "kv.kv_dtype",
                 "expected one of auto, bf16, fp16, fp32, fp8_e4m3, int4, int8, got 'fp7'"),
    "inside a named table": ('[profiles.fast]\nkv_dtype = "int8"\n[profiles.batch]\nmax_slots = 0\n',
                             "profiles.batch.max_slots", "expected int >= 1"),
    "optional of wrong type": ('[kv]\nkv_budget_mb = "lots"\n', "kv.kv_budget_mb",
                               "expected int, got str"),
    "devices vs tp": ('[[models]]\nid = "a"\nconfig = "c.json"\ntp = 2\ndevices = ["cpu"]\n',
                      "models[0].devices", "expected 2 devices"),
    "table as value": ("server = 3\n", "server", "expected object, got int"),
    # CUDA ranks need a card each, named by index (both would put every rank on cuda:0)
    "ranks on one card": ('[server]\ndevices = ["cuda:0"]\n[[models]]\nid = "a"\n'
                          'config = "c.json"\ntp = 2\n', "models[0].devices",
                          "tp = 2 needs 2 devices, got 1 (cuda:0): list a card per rank"),
    "one card twice": ('[[models]]\nid = "a"\nconfig = "c.json"\ntp = 2\n'
                       'devices = ["cuda:1", "cuda:1"]\n', "models[0].devices",
                       "cuda:1, cuda:1 name one card twice"),
    "a card without its index": ('[[models]]\nid = "a"\nconfig = "c.json"\ntp = 2\n'
                                 'devices = ["cuda", "cuda:1"]\n', "models[0].devices",
                                 "name each CUDA device by its index"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_neuron_config_one_clear_line(tmp_path, capsys, case):
    body, key, expected = BAD[case]
    path = tmp_path / "host.toml"
    path.write_text(body)
    rc, lines = check(path, capsys)
    assert rc == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}: {key}: "), lines[0]
    assert expected in lines[0]


def test_bad_router_config(tmp_path, capsys):
    path = tmp_path / "router.toml"
    path.write_text('[timeouts]\nrequest_secs = 0\n[aliases]\n"helexa/x" = "m"\n')
    rc, lines = check(path, capsys)
    assert rc == 2 and len(lines) == 1
    assert re.match(rf"{re.escape(str(path))}: timeouts\.request_secs: expected .*> 0", lines[0])


@pytest.mark.parametrize("aliases,line", [
    ('"helexa/balanced" = "tiny"\n"helexa/fast" = "helexa/balanced"\n',
     'aliases."helexa/fast": points at another alias helexa/balanced; expected a model id'),
    ('loop = "loop"\n', "aliases.loop: points at itself; expected a model id"),
], ids=["chain", "self"])
def test_an_alias_the_router_refuses_fails_the_check_with_its_words(tmp_path, capsys, aliases,
                                                                     line):
    path = tmp_path / "router.toml"
    path.write_text(f"[aliases]\n{aliases}")
    rc, lines = check(path, capsys)
    assert rc == 2 and lines == [f"{path}: {line}"]
    router = subprocess.run([sys.executable, "-m", "helexa.cli", "router", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert router.returncode == 1 and router.stderr.strip() == f"helexa router: {path}: {line}"


def test_syntax_error_and_missing_file(tmp_path, capsys):
    path = tmp_path / "n.toml"
    path.write_text("[kv\n")
    rc, lines = check(path, capsys)
    assert rc == 2 and lines[0].startswith(f"{path}: (syntax): ")
    rc, lines = check(tmp_path / "absent.toml", capsys)
    assert rc == 2 and "no such file" in lines[0]


def test_good_and_bad_files_together(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmax_slots = 0\n")
    rc = helexa_main(["config", "check", str(ASSET / "neuron" / "local.toml"), str(bad)])
    captured = capsys.readouterr()
    assert rc == 2 and "local.toml: ok" in captured.out and "engine.max_slots" in captured.err


def test_render_fills_defaults(capsys):
    assert helexa_main(["config", "render", str(ASSET / "neuron" / "local.toml")]) == 0
    out = capsys.readouterr().out
    assert "memory_fraction = 0.9" in out and 'id = "helexa/tiny-qwen3"' in out


@pytest.mark.parametrize("kind,body,keys", [
    ("neuron", '[server]\nnmae = "x"\n[kv]\nkv_dtype = "fp7"\n[engine]\nmax_slots = 0\n'
               '[[models]]\npath = "m"\n[profiles.fast]\nmax_slots = "x"\n',
     ["server.nmae", "kv.kv_dtype", "engine.max_slots", "models[0].id",
      "profiles.fast.max_slots"]),
    ("router", '[timeouts]\nrequest_secs = 0\nload_wait_secs = "x"\n[server]\nlisten = 5\n'
               '[[neurons.endpoints]]\nname = "a"\n',
     ["timeouts.request_secs", "timeouts.load_wait_secs", "server.listen",
      "neurons.endpoints[0].address"]),
    ("models", '[[models]]\nid = 3\nconfig = "c"\n[[models]]\nconfig = "x"\nfoo = 1\n',
     ["models[0].id", "models[1].foo", "models[1].id"]),
])
def test_check_reports_every_error_one_line_each(tmp_path, capsys, kind, body, keys):
    path = tmp_path / f"{kind}.toml"
    path.write_text(body)
    rc = helexa_main(["config", "check", "--kind", kind, str(path)])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert [line.split(": ")[1] for line in lines] == keys, lines
    assert all(line.startswith(f"{path}: ") for line in lines)


def test_a_file_that_is_not_utf8_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "router.toml"
    path.write_bytes(b'[aliases]\n"a" = "b"\n"\xff\xfe" = "c"\n')
    rc, lines = check(path, capsys)
    assert rc == 2 and len(lines) == 1
    assert lines[0] == f"{path}: (file): not UTF-8 (byte 0xff on line 3); TOML files are UTF-8"


def test_speculation_settings_are_checked_and_a_profile_overrides_them():
    from helexa.config.schema import EngineConfig, ProfileConfig, resolve_speculation

    assert EngineConfig(speculation="mtp").speculation == "mtp"
    with pytest.raises(ValueError, match="draft:m.*per model"):
        EngineConfig(speculation="draft:m")
    with pytest.raises(ValueError, match="expected \"ngram\""):
        EngineConfig(speculation="eagle")
    with pytest.raises(ValueError, match="spec_off_above"):
        EngineConfig(spec_full_below=0.8, spec_off_above=0.5)
    engine = EngineConfig(speculation="ngram", spec_k=3)
    assert resolve_speculation(engine).speculation == "ngram"
    fast = resolve_speculation(engine, None, ProfileConfig(speculation="off", spec_k=0))
    assert (fast.speculation, fast.spec_k) == ("off", 0)


def test_a_model_entry_sets_its_own_speculation_between_engine_and_profile():
    from helexa.config.schema import (
        EngineConfig,
        ModelEntry,
        NeuronConfig,
        ProfileConfig,
        resolve_speculation,
    )

    small = ModelEntry(id="small", path="s", preload=False)
    big = ModelEntry(id="big", path="b", speculation="draft:small", spec_k=6,
                     spec_off_above=0.9)
    cfg = NeuronConfig(engine=EngineConfig(speculation="ngram", spec_k=3), models=[big, small])
    mine = resolve_speculation(cfg.engine, big)  # [engine] < [[models]] entry
    assert (mine.speculation, mine.spec_k, mine.spec_off_above) == ("draft:small", 6, 0.9)
    assert mine.spec_full_below == 0.25  # not set by the entry: [engine]'s
    other = resolve_speculation(cfg.engine, small)
    assert (other.speculation, other.spec_k) == ("ngram", 3)
    busy = resolve_speculation(cfg.engine, big, ProfileConfig(speculation="off"))  # entry < profile
    assert (busy.speculation, busy.spec_k, busy.spec_off_above) == ("off", 6, 0.9)
    # a draft model is per model: [engine] and profiles refuse it, and it must be an entry
    with pytest.raises(ValueError, match="set per model"):
        EngineConfig(speculation="draft:small")
    with pytest.raises(ValueError, match="set per model"):
        ProfileConfig(speculation="draft:small")
    with pytest.raises(ValueError, match=r"models\[0\].speculation.*draft:nope"):
        NeuronConfig(models=[ModelEntry(id="big", path="b", speculation="draft:nope")])
    with pytest.raises(ValueError, match="tp = 1 only"):
        ModelEntry(id="big", path="b", tp=2, speculation="draft:small")


def test_the_engines_limits_are_the_configs_reload_keys_with_its_defaults():
    """Limits names every reload key of [admission], [kv] and [engine] (speculation's
    included) and nothing else, and its defaults are the config's: a knob added to the
    config reaches the engine, or this fails."""
    from helexa.config.schema import (
        AdmissionConfig,
        EngineConfig,
        KvConfig,
        NeuronConfig,
        field_apply,
    )
    from helexa.neuron.engine import messages
    from helexa.neuron.engine.spec import limits_from_config

    reload_keys = {name for section in (AdmissionConfig, KvConfig, EngineConfig)
                   for name in section.__struct_fields__
                   if field_apply(NeuronConfig, f"{section.__name__[:-6].lower()}.{name}")
                   == "reload"}
    assert set(messages.Limits.__struct_fields__) == reload_keys
    assert messages.Limits() == limits_from_config(NeuronConfig())


def test_a_drafter_name_reads_the_same_everywhere():
    from helexa.config.schema import Speculation, parse_drafter

    assert parse_drafter("draft:small") == ("draft", "small")
    assert parse_drafter("mtp") == ("mtp", "")
    assert Speculation(speculation="draft:small").draft_model == "small"
    assert Speculation(speculation="ngram").method == "ngram"
    with pytest.raises(ValueError, match="expected \"ngram\""):
        Speculation(speculation="eagle")
    with pytest.raises(ValueError, match="--speculation: 'draft:x'.*set per model"):
        parse_drafter("draft:x", "--speculation", per_model=False)


def test_two_neurons_of_one_name_are_refused_naming_the_second(tmp_path, capsys):
    # metrics, logs, the status page and a reload's diff name a neuron by it: two of one
    # name read as one, and a change to either went unseen
    path = tmp_path / "router.toml"
    path.write_text('[[neurons.endpoints]]\nname = "a"\naddress = "127.0.0.1:1"\n'
                    '[[neurons.endpoints]]\nname = "a"\naddress = "127.0.0.1:2"\n')
    rc, lines = check(path, capsys)
    assert rc == 2 and lines == [
        f"{path}: neurons.endpoints[1].name: expected unique neuron names, a repeats"]
