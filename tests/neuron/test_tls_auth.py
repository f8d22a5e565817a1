"""TLS and the shared token on a real gRPC server (in-process daemon, scripted engine)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from support.fake_engine import FakeEngineClient
from support.neuron import write_neuron_config

from helexa.config.schema import load_neuron_config
from helexa.neuron.auth import bearer, token_matches
from helexa.neuron.daemon import NeuronDaemon
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc


def test_token_matching_is_exact() -> None:
    assert token_matches((("authorization", "Bearer abc"),), "abc")
    assert not token_matches((("authorization", "Bearer abcd"),), "abc")
    assert not token_matches((("authorization", "abc"),), "abc")
    assert not token_matches((), "abc")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_with_a_certificate_the_neuron_speaks_tls_only(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    (tmp_path / "token").write_text("tok")
    path = write_neuron_config(tmp_path / "neuron.toml", {
        "server": {"listen": "localhost:0", "token_file": "token",
                   "tls_cert_file": "cert.pem", "tls_key_file": "key.pem"},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
    })

    async def run() -> tuple[str, grpc.StatusCode]:
        daemon = NeuronDaemon(path, load_neuron_config(path),
                              client_factory=FakeEngineClient.factory(lambda _p, _i: 5))
        await daemon.start()
        port = daemon.address.rsplit(":", 1)[1]
        try:
            creds = grpc.ssl_channel_credentials((tmp_path / "cert.pem").read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
                health = await neuron_pb2_grpc.NeuronStub(ch).Health(
                    pb.HealthRequest(), metadata=bearer("tok"), timeout=10)
            async with grpc.aio.insecure_channel(f"localhost:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await neuron_pb2_grpc.NeuronStub(ch).Health(
                        pb.HealthRequest(), metadata=bearer("tok"), timeout=5)
            return health.status, e.value.code()
        finally:
            await daemon.drain()

    status, plain = asyncio.run(run())
    assert status == "SERVING"
    assert plain == grpc.StatusCode.UNAVAILABLE
