"""SIGHUP's config comparison: what changed, and which changes apply without a restart."""

from __future__ import annotations

import msgspec

from helexa.config.schema import NeuronConfig
from helexa.neuron.daemon import config_diff, merge_reloadable


def _cfg(**over: dict) -> NeuronConfig:
    base = {
        "server": {"listen": "127.0.0.1:0"},
        "admission": {"max_in_flight": 4},
        "kv": {"block_size": 16},
        "models": [{"id": "a", "path": "a", "priority": 1}, {"id": "b", "path": "b"}],
        "profiles": {"batch": {"max_slots": 8}},
    }
    for k, v in over.items():
        base[k] = v
    return msgspec.convert(base, NeuronConfig)


def test_diff_names_changed_keys_with_models_matched_by_id() -> None:
    old = _cfg()
    new = _cfg(admission={"max_in_flight": 9}, kv={"block_size": 32},
               models=[{"id": "b", "path": "b", "priority": 3}, {"id": "a", "path": "a",
                                                                 "priority": 1}])
    changes = {key: (schema_key, a, b) for key, schema_key, a, b in config_diff(old, new)}
    assert changes == {
        "admission.max_in_flight": ("admission.max_in_flight", 4, 9),
        "kv.block_size": ("kv.block_size", 16, 32),
        "models.b.priority": ("models.priority", 0, 3),
    }


def test_merge_takes_reload_fields_and_keeps_restart_fields() -> None:
    old = _cfg()
    new = _cfg(admission={"max_in_flight": 9}, kv={"block_size": 32},
               server={"listen": "127.0.0.1:5", "drain_secs": 3.0},
               models=[{"id": "a", "path": "elsewhere", "priority": 7}, {"id": "b", "path": "b"}],
               profiles={"fast": {"max_in_flight": 2}})
    merged = merge_reloadable(old, new)
    assert merged.admission.max_in_flight == 9
    assert merged.server.drain_secs == 3.0
    assert merged.kv.block_size == 16  # restart
    assert merged.server.listen == "127.0.0.1:0"  # restart
    assert merged.model("a").priority == 7 and merged.model("a").path == "a"
    assert set(merged.profiles) == {"fast"}
