"""The GGUF files bench/gguf_vs_llamacpp.py compares on, quantised by llama.cpp's own quantiser:
bench/engine.py's 29M qwen3 written as an F32 GGUF (tests/support/gguf_reference.py's writer,
its vocabulary padded to the embedding's rows as llama.cpp's converter does), then
``llama_model_quantize`` of llama-cpp-python (the ``bench`` extra) to Q4_K_M and Q6_K.

    .venv/bin/python bench/llamacpp_files.py OUT_DIR     # OUT_DIR/{f32,q4_k_m,q6_k}.gguf
    .venv/bin/python bench/gguf_vs_llamacpp.py OUT_DIR/q4_k_m.gguf --threads 1

No weights are downloaded: the checkpoint is the one helexa.fixtures.tiny builds.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

TYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--threads", type=int, default=2, help="the quantiser's threads")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import llama_cpp
    from support.gguf_reference import write_gguf

    from helexa.fixtures.tiny import bench_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    src = args.out / "f32.gguf"
    write_gguf(bench_checkpoint(), src, lambda name: "F32")
    for name, ftype in TYPES.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = getattr(llama_cpp, ftype), args.threads
        out = args.out / f"{name}.gguf"
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize {name}: code {rc}")
        print(out, f"{out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
