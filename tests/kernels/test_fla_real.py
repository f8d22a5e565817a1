"""helexa's use of flash-linear-attention checked against fla's own kernels, not a stand-in:
fla-core at the version the ``cuda`` extra pins (`make setup` puts it in .venv/fla) runs
on CPU in Triton's interpreter (tests/support/fla_real.py, in a process of its own). The
prefill and decode probes agree at the flagship's head layout (Qwen3.5's group of 3 value
heads per key head, head size 128); a wrong chunk layout is refused; and a whole
hybrid model takes every fla path helexa has (a step's prefills in one chunked launch with
fla's chunk indices, decode with the norms and gates in the kernel, verification rows and
their settling, the gated norm), every probe agreeing as it loads, with the torch forms'
logits. The stand-in tests (test_gdn_fla.py) check the calls' shapes; this checks what fla
makes of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

FLA = Path(sys.prefix) / "fla"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict:
    if not (FLA / ".installed").exists():
        pytest.skip(f"fla-core is not installed in {FLA} (make setup installs it)")
    # the checkout's own helexa first (from a worktree the venv's editable install names
    # another), then fla
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(FLA)])}
    done = subprocess.run([sys.executable, "-P", "-W", "ignore",
                           str(ROOT / "tests/support/fla_real.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pinned_fla_takes_what_helexa_hands_it(report):
    # chunk indices (so the chunked kernel never reads the offsets back) and the gates in
    # the recurrent kernel: the paths helexa takes on this release
    assert report["takes"] == {"chunk_indices": True, "cu_seqlens_cpu": True, "gated": True}


def test_every_load_probe_agrees_with_fla_at_the_flagships_head_layout(report):
    probes = report["probes"]["2x6x128"]  # Qwen3.5's 3 value heads a key head, of 128
    assert probes == {name: "" for name in probes} and len(probes) == 3


def test_a_chunk_layout_fla_does_not_take_is_refused(report):
    why = report["wrong_chunks"]
    assert why.startswith("fla's chunked prefill kernel over several sequences")
    assert "off by" in why or "failed" in why


def test_a_hybrid_on_fla_gives_the_torch_forms_logits(report):
    model = report["model"]
    assert "torch chunked prefill, torch decode" in model["plain_backend"]
    for path in ("fla chunked prefill (a step's prefills in one launch)",
                 "fla fused decode (norms and gates in the kernel)",
                 "verification rows fla, one launch"):
        assert path in model["backend"]
    assert model["fallbacks"] == []
    layers = model["linear_layers"]
    calls = Counter((c["kind"], c["tokens"], c["varlen"], c["chunk_indices"],
                     c["gates_in_kernel"]) for c in model["calls"])
    assert calls == {
        ("chunked", 75, True, True, False): layers,  # step 1: both prefills, one launch
        ("recurrent", 4, False, False, False): 2 * layers,  # step 2's row, step 3's settling
        ("recurrent", 1, False, False, False): layers,  # step 2's decode row, gates in torch
        ("recurrent", 1, False, False, True): 2 * layers,  # steps 3, 4: pure decode
        ("norm", 0, False, False, False): 4 * layers}  # every step's output norm
    for step in model["steps"]:
        assert step["same_shape"] and step["same_argmax"], step
        # fla hands o back in fp16 where the torch rule keeps fp32: ~1% of the spread here
        assert step["max_error"] < 0.05 * step["spread"], step
