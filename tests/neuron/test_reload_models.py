"""A load applies the same ceilings a reload does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from support.fake_engine import run_fake_neuron
from support.neuron import NeuronClient, model_of, write_neuron_config


def _config(tmp_path: Path, model_dir: Path, **over: Any) -> dict[str, Any]:
    (tmp_path / "token").write_text("t")
    cfg: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "admission": {"max_in_flight": 16, "max_queue_depth": 256},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    }
    cfg.update(over)
    return cfg


def test_a_hybrid_loads_with_no_more_in_flight_than_its_state_slots(
        tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    """max_in_flight past the state slots a hybrid's pool holds is capped at load as a
    reload caps it: the engine, Watch and the log say the figure it runs."""
    path = write_neuron_config(tmp_path / "neuron.toml", _config(
        tmp_path, tiny_checkpoint("qwen3_5"), admission={"max_in_flight": 100_000},
        kv={"kv_budget_mb": 64}))

    async def body(stub, daemon, engine):
        async with NeuronClient(daemon.address, "t") as c:
            st = await c.watch_until(lambda st: True)
        return (daemon.residency.models["tiny"].num_state_slots, engine.spec.limits,
                engine.limits, model_of(st).admission.max_in_flight)

    with structlog.testing.capture_logs() as logs:
        slots, at_start, now, shown = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert 0 < slots < 100_000
    assert at_start.max_in_flight == now.max_in_flight == shown == slots
    capped = [n for e in logs if e["event"] == "model.limits_capped" for n in e["capped"]]
    assert any(n.startswith(f"max_in_flight: 100000 is more than the {slots}")
               for n in capped), capped
