"""`helexa ctl`: runtime operations on a running neuron over its gRPC API.

    helexa ctl [--address HOST:PORT | --config NEURON.toml] [--token-file F] status [--json]
    helexa ctl ... load MODEL
    helexa ctl ... unload MODEL [--drain | --force]
    helexa ctl ... profile MODEL NAME

With --config the address and token come from the neuron's own config
(server.address_file, server.token_file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from helexa.config.schema import ConfigError, load_neuron_config, read_secret, resolve_path
from helexa.neuron.auth import bearer
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc

MIB = 1024 * 1024


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helexa ctl", description="runtime operations on a neuron")
    p.add_argument("--address", help="neuron gRPC address host:port")
    p.add_argument("--config", help="the neuron's config: address and token from it")
    p.add_argument("--token-file", help="file holding the neuron's token")
    p.add_argument("--tls-ca", help="PEM CA (or the neuron's certificate) to connect with TLS")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer")
    sub = p.add_subparsers(dest="op", required=True)
    s = sub.add_parser("status", help="models, their state, ledger and limits")
    s.add_argument("--json", action="store_true", help="print the raw status as JSON")
    sub.add_parser("load", help="load a catalogue model").add_argument("model")
    u = sub.add_parser("unload", help="unload a model")
    u.add_argument("model")
    g = u.add_mutually_exclusive_group()
    g.add_argument("--drain", action="store_true", help="let in-flight work finish first")
    g.add_argument("--force", action="store_true", help="abort in-flight work")
    pr = sub.add_parser("profile", help="switch a model's serving profile")
    pr.add_argument("model")
    pr.add_argument("name", help='profile name ("" = base settings)')
    return p


def _endpoint(args: argparse.Namespace) -> tuple[str, str | None, bytes | None]:
    """(address, token, TLS root certificate or None)."""
    address, token, ca = args.address, None, None
    if args.config:
        cfg = load_neuron_config(args.config)
        if address is None and cfg.server.address_file:
            address = resolve_path(args.config, cfg.server.address_file).read_text().strip()
        if address is None:
            address = cfg.server.listen
        token = read_secret(args.config, cfg.server.token_file)
        if cfg.server.tls_cert_file:  # a self-signed neuron: trust its own certificate
            ca = resolve_path(args.config, cfg.server.tls_cert_file).read_bytes()
    if args.token_file:
        token = Path(args.token_file).expanduser().read_text().strip()
    if args.tls_ca:
        ca = Path(args.tls_ca).expanduser().read_bytes()
    if not address:
        raise ConfigError("ctl: expected --address or --config")
    return address, token, ca


def format_status(st: pb.ModelsResponse) -> str:
    """The human-readable status table."""
    lines = [f"{'model':<32} {'state':<10} {'profile':<10} {'kv_dtype':<9} {'attn':<6} "
             f"{'ctx':>7} {'in_fl':>5} {'queue':>5} {'kv free/total MiB':>18}"]
    resident = {m.model: m for m in st.models}
    for e in st.catalogue:
        m = resident.get(e.model)
        if m is None:
            lines.append(f"{e.model:<32} {'-':<10} {e.profile or '-':<10}")
            continue
        state = pb.ModelState.Name(m.state).removeprefix("MODEL_STATE_").lower()
        kv = f"{m.kv.free_bytes / MIB:.1f}/{m.kv.total_bytes / MIB:.1f}"
        attn = m.attention_backend.split(" ", 1)[0] or "-"  # the name; details below
        lines.append(f"{m.model:<32} {state:<10} {m.profile or '-':<10} {m.kv_dtype:<9} "
                     f"{attn:<6} {m.limits.context:>7} {m.in_flight:>5} {m.queued:>5} {kv:>18}")
        if m.state in (pb.MODEL_STATE_SWITCHING, pb.MODEL_STATE_LOADING):
            # a router sends it nothing until it is ready: what comes meanwhile waits there
            lines.append(f"    {state}: requests sent meanwhile wait at each router, in no "
                         "queue here (helexa_router_held_requests; `held by router` on the "
                         "router's /status page)")
        if " " in m.attention_backend:
            lines.append(f"    attention: {m.attention_backend}")
        if m.activations:
            lines.append(f"    activations: {m.activations}")
        if m.error:
            lines.append(f"    error: {m.error}")
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    address, token, ca = _endpoint(args)
    md = bearer(token) if token else ()
    channel = (grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) if ca
               else grpc.aio.insecure_channel(address))
    async with channel:
        stub = neuron_pb2_grpc.NeuronStub(channel)
        call: dict[str, Any] = {"metadata": md, "timeout": args.timeout}
        if args.op == "status":
            st = await stub.Models(pb.ModelsRequest(), **call)
            print(json.dumps(MessageToDict(st), indent=2) if args.json else format_status(st))
        elif args.op == "load":
            res = await stub.Load(pb.LoadRequest(model=args.model, principal="ctl", retry_failed=True), **call)
            state = pb.ModelState.Name(res.status.state).removeprefix("MODEL_STATE_").lower()
            print(f"{args.model}: {state}" + (f" ({res.status.error})" if res.status.error else ""))
            for m in res.evicted:
                print(f"evicted {m}")
            return 0 if res.status.state == pb.MODEL_STATE_READY else 1
        elif args.op == "unload":
            res = await stub.Unload(pb.UnloadRequest(model=args.model, drain=args.drain,
                                                     force=args.force), **call)
            print(f"{args.model}: {'unloaded' if res.unloaded else 'was not resident'}")
        elif args.op == "profile":
            res = await stub.SetProfile(pb.SetProfileRequest(model=args.model,
                                                             profile=args.name), **call)
            for c in res.changed or ["(nothing changed)"]:
                print(c)
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except ConfigError as e:
        print(f"helexa ctl: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:
        code = dict(e.trailing_metadata() or ()).get("helexa-code", "")
        print(f"helexa ctl: {e.code().name}{f' {code}' if code else ''}: {e.details()}",
              file=sys.stderr)
        return 1
