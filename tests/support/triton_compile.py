"""Compile helexa's quantised-KV, grouped int8, int4-tile and routed MoE Triton kernels for an sm90 card down to PTX, on any
machine (no GPU: Triton's own compiler stages, to PTX and not to a cubin), and print what
each produced as JSON: run by tests/kernels/test_triton_compile.py in a process of its own,
without TRITON_INTERPRET, so that what only a real compile sees (a module global read in a
kernel, a type a load or dot will not take, registers spilled to local memory) is caught
where the interpreter, which runs the same source in numpy, passes."""

from __future__ import annotations

import json
import re
import sys

import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from helexa.kernels.cuda import _int4_tiles_triton as i4
from helexa.kernels.cuda import _int8g_triton as i8
from helexa.kernels.cuda import _moe_routed_triton as mr
from helexa.kernels.cuda import _quant_decode_triton as qd
from helexa.kernels.cuda import _quant_write_triton as qw
from helexa.kernels.cuda import int8g
from helexa.kernels.cuda.quant_decode import _warps

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)


def ptx(fn: object, types: list[str], consts: dict[str, object], warps: int,
        div16: tuple[str, ...] = ()) -> str:
    """``div16``: arguments known 16-divisible, as Triton specialises them at a launch (a
    pointer torch allocated; an int not in the kernel's do_not_specialize)."""
    jit = triton.jit(fn)
    sig = dict(zip(jit.arg_names, types, strict=False))
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(jit.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(jit, sig, consts, attrs)
    opts = BACKEND.parse_options({"num_warps": warps, "num_stages": 3})
    ctx = ir.context()
    ir.load_dialects(ctx)
    BACKEND.load_dialects(ctx)
    mod = src.make_ir(TARGET, opts, BACKEND.get_codegen_implementation(opts),
                      BACKEND.get_module_map(), ctx)
    stages: dict[str, object] = {}
    BACKEND.add_stages(stages, opts, src.language)
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[stage](mod, {})  # type: ignore[operator]
    return str(mod)


def stats(text: str) -> dict[str, int]:
    pats = {"spills": "ld.local", "div_full": "div.full.f32", "div_rn": "div.rn",
            "b16_stores": "st.global.b16", "v4_stores": "st.global.v4.",
            "v4_loads": "ld.global.v4."}
    return {k: len(re.findall(re.escape(p), text)) for k, p in pats.items()}


def main() -> int:
    out: dict[str, object] = {}
    d, group, dp = 128, 6, 128  # Qwen3.5-27B's attention: head_dim 256 is the other size
    for kind, name in ((0, "int8"), (1, "fp8_e4m3"), (2, "int4")):
        data = "*i8" if kind == 0 else "*u8"
        ns, dd = (-(-d // 32), d // 2) if kind == 2 else (1, d)
        try:
            out[f"split/{name}"] = stats(ptx(qd.split_kernel, [
                "*bf16", data, "*fp32", data, "*fp32", "*i32", "*i32", "*fp32", "*fp32", "fp32",
                "i32", "i32", "i32", "i32", "i32"], dict(
                KV_HEADS=4, GROUP=group, GP=16, HEAD_DIM=d, DP=dp, DATA_DIM=dd,
                NUM_SCALES=ns, KIND=kind, BLOCK_SIZE=16, BLOCK_N=32, DOT_F32=False),
                _warps(dp)))
            out[f"prefill/{name}"] = stats(ptx(qd.prefill_kernel, [
                "*bf16", data, "*fp32", data, "*fp32", "*i64", "*bf16", "i64", "i32", "i32",
                "fp32", "i32", "i32", "i32", "i32"], dict(
                KV_HEADS=4, GROUP=group, TOK=10, R=64, HEAD_DIM=d, DP=dp, DATA_DIM=dd,
                NUM_SCALES=ns, KIND=kind, BLOCK_N=32, SLOTS=True, DOT_F32=False), _warps(dp)))
            out[f"write/{name}"] = stats(ptx(qw.write_kernel, [
                "*bf16", "*bf16", "*i64", data, "*fp32", data, "*fp32", "i32", "i32", "i32",
                "i32"], dict(KV_HEADS=4, HEAD_DIM=d, DP=dp, DATA_DIM=dd, NUM_SCALES=ns,
                            NSP=1 << (ns - 1).bit_length(), KIND=kind), 4))
        except Exception as e:  # noqa: BLE001 - reported: the test names the kernel
            out[f"failed/{name}"] = f"{type(e).__name__}: {e}"[-800:]
    out["merge"] = stats(ptx(qd.merge_kernel, ["*fp32", "*fp32", "*bf16", "i32", "i32", "i32"],
                             dict(HEADS=24, HEAD_DIM=d, DP=dp, SP=64), 4))
    # the grouped int8 decode kernel (int8g.run's launch: 4 warps): a load of scales per
    # group, per-row int8's one group a row (one scale a step), a scale per value; fp32
    # models' shallower steps
    for dtype, group, zeros in (("bf16", 32, True), ("bf16", 5120, False), ("fp16", 96, False),
                                ("fp32", 5120, False)):
        block_k = int8g.BLOCK_K_FP32 if dtype == "fp32" else int8g.BLOCK_K
        dot = {"bf16": i8.tl.bfloat16, "fp16": i8.tl.float16, "fp32": i8.tl.float32}[dtype]
        out[f"int8g/{dtype}/{group}"] = stats(ptx(i8.int8g_kernel, [
            f"*{dtype}", "*i8", f"*{dtype}", f"*{dtype}", "*fp32"] + ["i32"] * 7, dict(
            G=group, GROUPING=i8.grouping(group, block_k), HAS_ZEROS=zeros, DOT=dot,
            PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=int8g.BLOCK_M,
            BLOCK_N=int8g.BLOCK_N, BLOCK_K=block_k), 4))
    # the int4 dequantisation into tiles (int4_tiles.dequantize's launch: 4 warps) at the
    # deepest and the shallowest inner k-tiling; its pointers and the tile's row stride
    # specialised 16-divisible, as every launch's are
    for inner, group in ((8, 128), (2, 32)):
        out[f"int4_tiles/{inner}/{group}"] = stats(ptx(i4.int4_tile_kernel, [
            "*i32", "*bf16", "*bf16", "i32", "i32", "i32", "i32", "i32"],
            dict(INNER=inner, G=group), 4, ("p_ptr", "sz_ptr", "out_ptr", "stride_out")))
    # the routed MoE expert product (moe_routed.run's launch: 4 warps) over each stack kind:
    # bf16, grouped int8 (Q8_0 / Q5_K's 32, Q6_K's 16), torch's int4 at inner 8 and 2; the
    # stack's shape and strides specialised as a real stack's are (multiples of 16)
    stack_args = ("w_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "k_span", "stride_we",
                  "stride_se", "stride_s")
    for kind, wt, group, inner in ((0, "*bf16", 1, 1), (1, "*i8", 32, 1), (1, "*i8", 16, 1),
                                   (2, "*i32", 32, 8), (2, "*i32", 128, 2)):
        out[f"moe_routed/{kind}/{group}/{inner}"] = stats(ptx(mr.routed_kernel, [
            "*bf16", "*i32", "*i32", wt, "*bf16", "*bf16", "*fp32"] + ["i32"] * 8, dict(
            KIND=kind, G=group, GROUPING=i8.grouping(group, 128), HAS_ZEROS=kind == 1,
            INNER=inner, BLOCK_N=32, BLOCK_K=128), 4, stack_args))
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
