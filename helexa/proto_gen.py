"""Generate the gRPC stubs under helexa/proto/ from proto/ (grpcio-tools).

`python -m helexa.proto_gen` rewrites them; `--check` exits 1 when the
committed stubs differ from what the proto would generate (a test runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILE = "helexa/neuron/v1/neuron.proto"
OUT_DIR = ROOT / "helexa" / "proto"
GENERATED = ("neuron_pb2.py", "neuron_pb2.pyi", "neuron_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Run protoc into a temporary folder; return {file name: text}."""
    from grpc_tools import protoc  # dev dependency, only needed here

    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
            str(PROTO_DIR / PROTO_FILE),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with {rc}")
        gen = Path(tmp) / "helexa" / "neuron" / "v1"
        out = {}
        for name in GENERATED:
            text = (gen / name).read_text()
            # The proto package path (helexa.neuron.v1) is not an import path
            # here; the stubs live flat in helexa.proto.
            text = re.sub(r"from helexa\.neuron\.v1 import", "from helexa.proto import", text)
            out[name] = text
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = ap.parse_args(argv)
    fresh = generate()
    stale = [n for n, t in fresh.items()
             if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != t]
    if args.check:
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run python -m helexa.proto_gen",
                  file=sys.stderr)
            return 1
        return 0
    for name, text in fresh.items():
        (OUT_DIR / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
