"""Start-up: a context the pool cannot hold refuses to start; an unsupported model fails alone."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.neuron import NeuronClient, NeuronProcess, model_of, write_neuron_config

from helexa.proto import neuron_pb2 as pb


def test_a_context_the_pool_cannot_hold_refuses_to_start_showing_the_arithmetic(
        neuron_dir: Path, neuron_main_config: dict[str, Any]) -> None:
    cfg = copy.deepcopy(neuron_main_config)
    cfg["models"][0]["context"] = 4096  # a 1 MiB pool of 512 B tokens holds 2048
    path = write_neuron_config(neuron_dir / "too-long.toml", cfg)
    out = subprocess.run([sys.executable, "-m", "helexa.cli", "neuron", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "NEURON LISTENING" not in out.stdout
    assert "context" in out.stderr and "4,096" in out.stderr and "2,048" in out.stderr


def test_a_model_that_cannot_load_fails_alone_and_says_why(neuron_tight: NeuronProcess,
                                                          neuron_token: str) -> None:
    async def run() -> pb.NeuronStatus:
        async with NeuronClient(neuron_tight.address, neuron_token) as c:
            return await c.status()

    st = asyncio.run(run())
    hybrid = model_of(st, "hybrid")
    assert hybrid.state == pb.MODEL_STATE_FAILED
    # beast's hybrid config, served now, but with no weights in the folder
    assert "no *.safetensors weights" in hybrid.error
    assert "\n" not in hybrid.error
    assert model_of(st, "tiny").state == pb.MODEL_STATE_READY
    assert neuron_tight.proc.poll() is None
