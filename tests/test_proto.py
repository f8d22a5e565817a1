"""The committed gRPC stubs are what the proto generates; a proto edit makes them stale."""

from __future__ import annotations

import shutil
import subprocess
import sys

from helexa import proto_gen


def test_stubs_are_fresh():
    r = subprocess.run([sys.executable, "-m", "helexa.proto_gen", "--check"],
                       capture_output=True, text=True, cwd=proto_gen.ROOT)
    assert r.returncode == 0, r.stderr


def test_check_fails_after_a_proto_edit(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "proto"
    shutil.copytree(proto_gen.PROTO_DIR, copy)
    proto = copy / proto_gen.PROTO_FILE
    text = proto.read_text()
    # One more message is what any forgotten regeneration looks like.
    proto.write_text(text + "\n// added by a test\nmessage StaleCheckProbe { string probe = 1; }\n")
    monkeypatch.setattr(proto_gen, "PROTO_DIR", copy)
    assert proto_gen.main(["--check"]) == 1
    assert "stale gRPC stubs" in capsys.readouterr().err
    # The committed stubs are untouched by a check.
    assert "StaleCheckProbe" not in (proto_gen.OUT_DIR / "neuron_pb2.py").read_text()


def test_service_has_the_designed_methods():
    from helexa.proto import neuron_pb2

    service = neuron_pb2.DESCRIPTOR.services_by_name["Neuron"]
    assert {m.name for m in service.methods} >= {
        "Generate", "Complete", "Watch", "Models", "Load", "Unload", "SetProfile", "Health"}
    assert service.methods_by_name["Generate"].server_streaming
    complete = service.methods_by_name["Complete"]
    assert not complete.server_streaming and not complete.client_streaming
    assert complete.input_type.name == "GenerateRequest"
    assert complete.output_type.name == "GenerateResponse"
    assert service.methods_by_name["Watch"].server_streaming
