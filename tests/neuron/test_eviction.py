"""Whom to evict for a new model: exact choices of the pure policy (helexa/neuron/eviction.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helexa.config.schema import ModelEntry
from helexa.neuron.eviction import MIB, evictions_for
from helexa.neuron.resident_model import ModelState, ResidentModel
from helexa.refusal import Refusal


def model(name: str, mb: int, devices: list[str], *, priority: int = 0, used_ms: int = 0,
          state: ModelState = ModelState.READY, active: int = 0) -> ResidentModel:
    plan = SimpleNamespace(weight_bytes_per_card=mb * MIB, kv_budget_bytes=0)
    return ResidentModel(entry=ModelEntry(id=name, path="m", priority=priority), state=state, plan=plan,
                         devices=devices, last_used_unix_ms=used_ms, active=active)


def test_fits_already_evicts_nobody() -> None:
    new = model("new", 40, ["cuda:0"], state=ModelState.LOADING)
    assert evictions_for(new, [new, model("a", 60, ["cuda:0"])], cap_mb=100) == []


def test_least_recently_used_first_and_only_as_many_as_needed() -> None:
    old, mid, recent = (model("old", 30, ["cuda:0"], used_ms=1),
                        model("mid", 30, ["cuda:0"], used_ms=2),
                        model("recent", 30, ["cuda:0"], used_ms=3))
    new = model("new", 50, ["cuda:0"], state=ModelState.LOADING)
    chosen = evictions_for(new, [recent, new, mid, old], cap_mb=100)
    assert [m.model_id for m in chosen] == ["old", "mid"]  # 90 + 50 > 100, 30 + 50 fits


def test_busy_failed_higher_priority_and_other_cards_are_never_chosen() -> None:
    new = model("new", 50, ["cuda:1"], priority=1, state=ModelState.LOADING)
    others = [model("busy", 20, ["cuda:1"], active=1),
              model("high", 20, ["cuda:1"], priority=2),
              model("failed", 90, ["cuda:1"], state=ModelState.FAILED),  # holds nothing
              model("elsewhere", 90, ["cuda:0"]),
              model("idle", 40, ["cuda:1"], used_ms=9)]
    assert [m.model_id for m in evictions_for(new, others, cap_mb=100)] == ["idle"]
    bigger = model("bigger", 70, ["cuda:1"], priority=1, state=ModelState.LOADING)
    with pytest.raises(Refusal) as e:  # 20 + 20 + 70 > 100 once idle is gone: no way
        evictions_for(bigger, others[:-1], cap_mb=100)
    assert e.value.code == "overloaded"
    assert e.value.message == ("not enough device memory for `bigger`: it needs 70 MiB per "
                               "card of 100 MiB, and no idle model of priority <= 1 can make room")


def test_a_bare_cuda_and_cuda_0_are_one_card_to_the_residency(tmp_path) -> None:
    """A model on the neuron's ["cuda"] and one naming ["cuda:0"] share a card: the
    residency names both cuda:0, so the second evicts the first rather than load beside it
    and run the card out of memory."""
    import msgspec

    from helexa.config.schema import NeuronConfig
    from helexa.neuron.residency import Residency

    cfg = msgspec.convert({"server": {"devices": ["cuda"], "device_memory_mb": 100},
                           "models": [{"id": "a", "path": "m"},
                                      {"id": "b", "path": "m", "devices": ["cuda:0"]}]},
                          NeuronConfig)
    res = Residency(cfg, tmp_path / "neuron.toml")
    assert [res._devices_of(e) for e in cfg.models] == [["cuda:0"], ["cuda:0"]]
    a = model("a", 70, res._devices_of(cfg.models[0]), used_ms=1)
    b = model("b", 70, res._devices_of(cfg.models[1]), state=ModelState.LOADING)
    assert [m.model_id for m in evictions_for(b, [a, b], cap_mb=100)] == ["a"]


def test_nvidia_smi_is_asked_for_the_card_cuda_numbers(monkeypatch) -> None:
    """cuda:N counts the cards CUDA_VISIBLE_DEVICES lists, which nvidia-smi ignores: the
    memory query names the listed card; a failed query is asked again, not remembered."""
    from helexa.neuron import eviction

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-5f1c")
    assert [eviction.nvidia_smi_card(d) for d in ("cuda", "cuda:0", "cuda:1")] == [
        "2", "2", "GPU-5f1c"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert eviction.nvidia_smi_card("cuda:3") == "3"
    asked, answers = [], iter([(1, ""), (0, "81559\n")])

    def run(argv, **kw):
        asked.append(argv[-1])
        rc, out = next(answers)
        return SimpleNamespace(returncode=rc, stdout=out)

    monkeypatch.setattr(eviction.subprocess, "run", run)
    monkeypatch.setattr(eviction, "_CARD_MB", {})
    assert eviction._cuda_memory_mb("cuda:3") is None  # nvidia-smi failed this once
    assert eviction._cuda_memory_mb("cuda:3") == 81559
    assert eviction._cuda_memory_mb("cuda:3") == 81559 and asked == ["3", "3"]  # then kept
