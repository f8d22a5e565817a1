"""helexa's quantised-KV and grouped int8 Triton kernels compiled for an sm90 card down to PTX on this
machine (tests/support/triton_compile.py, in a process without TRITON_INTERPRET): the
interpreter the other kernel tests use runs the source in numpy and let a kernel through
that read a module global, which a real compile refuses (the write kernel's first
version: on a GPU its probe would have failed and it would never have run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "triton_compile.py"


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, object]:
    try:  # the compiler's stages, as the script calls them
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this Triton has no compiler to call from here ({e})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_every_quantised_kv_kernel_compiles_for_sm90(compiled):
    assert not [k for k in compiled if k.startswith("failed/")], compiled
    assert {k for k in compiled
            if not k.startswith(("int8g/", "int4_tiles/", "moe_routed/"))} == {
        f"{k}/{d}" for k in ("split", "prefill", "write")
        for d in ("int8", "fp8_e4m3", "int4")} | {"merge"}


def test_the_grouped_int8_kernel_compiles_for_each_way_it_reads_scales(compiled):
    # groups of 32 (a load a group), per-row int8's one group a row, groups of 96 (a scale
    # a value), and an fp32 model's shallower steps
    assert {k for k in compiled if k.startswith("int8g/")} == {
        "int8g/bf16/32", "int8g/bf16/5120", "int8g/fp16/96", "int8g/fp32/5120"}


def test_the_int4_tile_kernel_compiles_at_each_inner_k_tiling(compiled):
    assert {k for k in compiled if k.startswith("int4_tiles/")} == {
        "int4_tiles/8/128", "int4_tiles/2/32"}


def test_the_int4_tile_kernel_stores_a_rows_values_16_bytes_at_once(compiled):
    # the dequantised tile is 4 times the bytes the kernel reads: written as 2-byte values
    # 4 bytes apart, each warp's store touched 8 rows' sectors a quarter full; its deepest
    # tiling (a thread's 8 neighbouring values) must go out as one 16-byte store
    got = compiled["int4_tiles/8/128"]
    assert got["v4_stores"] >= 1 and got["b16_stores"] == 0, got
    assert compiled["int4_tiles/2/32"]["b16_stores"] == 0, compiled["int4_tiles/2/32"]


def test_the_routed_moe_kernel_reads_each_stack_kind_16_bytes_at_once(compiled):
    # bf16, int8 at groups of 32 and 16, torch's int4 at inner 8 and 2: each thread's share
    # of the expert's weight comes in 16-byte loads (an int4 row's words whole, not a word
    # per value)
    kinds = {k: v for k, v in compiled.items() if k.startswith("moe_routed/")}
    assert set(kinds) == {"moe_routed/0/1/1", "moe_routed/1/32/1", "moe_routed/1/16/1",
                          "moe_routed/2/32/8", "moe_routed/2/128/2"}
    assert {k: v["v4_loads"] for k, v in kinds.items() if v["v4_loads"] < 1} == {}


def test_no_kernel_spills_registers_at_its_launch_warps(compiled):
    # at 4 warps a 128-dim split program held 255 registers and spilled (quant_decode._warps)
    assert {k: v["spills"] for k, v in compiled.items() if v["spills"]} == {}


def test_the_write_kernel_divides_correctly_rounded_as_torch_does(compiled):
    # its stored bytes must be the torch form's: the quotient x / scale correctly rounded,
    # the scale amax times the reciprocal (no approximate division anywhere)
    for name in ("int8", "fp8_e4m3", "int4"):
        got = compiled[f"write/{name}"]
        assert got["div_full"] == 0 and got["div_rn"] > 0, (name, got)
