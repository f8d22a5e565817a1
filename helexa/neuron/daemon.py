"""`helexa neuron --config FILE`: the per-host daemon.

Start-up: parse and plan the config (a context the pool cannot hold refuses
to start, printing the arithmetic), bind the gRPC server (port 0 allowed),
preload the catalogue's models (each in its own engine process), then print
`NEURON LISTENING host:port` and write server.address_file. SIGHUP re-reads
the config and applies its reload-safe changes at once (see `config_diff`);
SIGTERM drains: new requests are refused `shutting_down`, in-flight work may
finish for server.drain_secs, the engines stop and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import msgspec
import structlog

from helexa.config.schema import (
    ConfigError,
    NeuronConfig,
    field_apply,
    load_neuron_config,
    read_secret,
    resolve_path,
)
from helexa.fd_limit import raise_fd_limit
from helexa.log import setup_logging
from helexa.neuron.auth import TokenAuthInterceptor, server_credentials
from helexa.neuron.metrics import NeuronMetrics
from helexa.neuron.reconfigure import reconfigure
from helexa.neuron.residency import ClientFactory, Residency
from helexa.neuron.resident_model import ModelState
from helexa.neuron.servicer import NeuronServicer
from helexa.neuron.status import StatusHub, snapshot
from helexa.proto import neuron_pb2_grpc

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="neuron")


def config_diff(old: NeuronConfig, new: NeuronConfig) -> list[tuple[str, str, Any, Any]]:
    """Changed fields as (shown key, schema key for field_apply, old, new).

    Models are matched by id (`models.<id>.priority`), profiles by name; a
    model added or removed is reported under `models.<id>` (a restart field).
    """
    def flat(cfg: NeuronConfig) -> dict[str, tuple[str, Any]]:
        out: dict[str, tuple[str, Any]] = {}
        plain = msgspec.to_builtins(cfg)
        for section, body in plain.items():
            if section == "models":
                for m in body:
                    out[f"models.{m['id']}"] = ("models.id", "present")
                    for k, v in m.items():
                        out[f"models.{m['id']}.{k}"] = (f"models.{k}", v)
            elif section == "profiles":
                for name, prof in body.items():
                    for k, v in prof.items():
                        out[f"profiles.{name}.{k}"] = (f"profiles.{k}", v)
            else:
                for k, v in body.items():
                    out[f"{section}.{k}"] = (f"{section}.{k}", v)
        return out

    a, b = flat(old), flat(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        schema_key = (a.get(key) or b.get(key))[0]  # type: ignore[index]
        va = a[key][1] if key in a else None
        vb = b[key][1] if key in b else None
        if va != vb:
            changes.append((key, schema_key, va, vb))
    return changes


def merge_reloadable(old: NeuronConfig, new: NeuronConfig) -> NeuronConfig:
    """`old` with every reload-safe field taken from `new` (restart fields stay)."""
    merged = msgspec.to_builtins(old)
    fresh = msgspec.to_builtins(new)
    merged["profiles"] = fresh["profiles"]  # profiles are data read at switch time
    for section in ("server", "admission", "kv", "engine"):
        for k, v in fresh[section].items():
            if field_apply(NeuronConfig, f"{section}.{k}") == "reload":
                merged[section][k] = v
    new_models = {m["id"]: m for m in fresh["models"]}
    for m in merged["models"]:
        for k, v in new_models.get(m["id"], {}).items():
            if field_apply(NeuronConfig, f"models.{k}") == "reload":
                m[k] = v
    return msgspec.convert(merged, NeuronConfig)



# A router pings every connection after timeouts.keepalive_secs (at least 1 s) of silence to
# tell a hung host from a busy one (helexa/router/neuron_channel.py). gRPC documents that a
# server by default counts a ping less than 5 minutes after the last as a strike when it has
# sent no data since, and past two closes the connection (GOAWAY too_many_pings), which
# would cut every call of a neuron whose replies paused (a long prefill). Pings half a
# second apart are accepted here, so the router's may come every second.
MIN_PING_INTERVAL_MS = 500


def server_options() -> list[tuple[str, int]]:
    """The neuron's gRPC server options (the test fake neuron serves with them too)."""
    return [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 2)]


class NeuronDaemon:
    """The daemon's parts wired together; usable in-process (tests) or from main()."""

    def __init__(self, config_path: Path, cfg: NeuronConfig, *,
                 client_factory: ClientFactory | None = None) -> None:
        self.config_path = Path(config_path)
        self.cfg = cfg
        self.hub = StatusHub(lambda: snapshot(cfg.server.name, self.residency,
                                              self.servicer.draining),
                             heartbeat_secs=cfg.server.heartbeat_secs)
        self.residency = Residency(cfg, self.config_path, client_factory=client_factory,
                                   on_change=self.hub.changed)
        self.metrics = NeuronMetrics(self.residency)
        self.servicer = NeuronServicer(cfg.server.name, self.residency, self.hub, self.metrics)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.metrics_address = ""
        self._stop = asyncio.Event()

    async def start(self) -> str:
        """Bind and start the gRPC server (and metrics); returns host:port."""
        srv = self.cfg.server
        token = read_secret(self.config_path, srv.token_file)
        interceptors = [TokenAuthInterceptor(token)] if token else []
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options())
        neuron_pb2_grpc.add_NeuronServicer_to_server(self.servicer, self.server)
        host = srv.listen.rpartition(":")[0] or "127.0.0.1"
        if srv.tls_cert_file and srv.tls_key_file:
            creds = server_credentials(resolve_path(self.config_path, srv.tls_cert_file),
                                       resolve_path(self.config_path, srv.tls_key_file))
            port = self.server.add_secure_port(srv.listen, creds)
        else:
            port = self.server.add_insecure_port(srv.listen)
        if port == 0:
            raise OSError(f"server.listen: could not bind {srv.listen}")
        await self.server.start()
        self.address = f"{host}:{port}"
        if srv.metrics_listen:
            self.metrics_address, _ = self.metrics.serve(srv.metrics_listen)
        log.info("neuron.started", address=self.address, metrics=self.metrics_address or None,
                 tls=bool(srv.tls_cert_file), auth=bool(token), pid=os.getpid())
        return self.address

    def announce(self) -> None:
        """Tell whoever started us where we are (stdout line + address file)."""
        if self.metrics_address:
            print(f"NEURON METRICS {self.metrics_address}", flush=True)
        print(f"NEURON LISTENING {self.address}", flush=True)
        if self.cfg.server.address_file:
            path = resolve_path(self.config_path, self.cfg.server.address_file)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(self.address + "\n")
            tmp.replace(path)

    async def run(self) -> int:
        await self.start()
        preload = asyncio.ensure_future(self.residency.preload())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({preload, stop}, return_when=asyncio.FIRST_COMPLETED)
        if preload.done():
            preload.result()
            self.announce()
            await stop
        else:  # SIGTERM while loading: stop the loads, then drain as usual
            preload.cancel()
            await asyncio.gather(preload, return_exceptions=True)
        await self.drain()
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------- SIGHUP

    def reload(self) -> list[str]:
        """Re-read the config; apply reload-safe changes, report restart ones; keep on error."""
        try:
            new = load_neuron_config(self.config_path)
        except ConfigError as e:
            log.error("config.reload_refused", error=str(e), kept="running config")
            return []
        try:
            check_plans(self.config_path, new)
        except ConfigError as e:  # only restart fields can break a plan: warn, apply the rest
            log.warning("config.would_not_start", error=str(e))
        applied: list[str] = []
        profile_changes: list[tuple[str, str]] = []
        for key, schema_key, old, value in config_diff(self.cfg, new):
            try:
                rule = field_apply(NeuronConfig, schema_key)
            except KeyError:
                rule = "restart"
            if rule == "reload":
                log.info("config.changed", key=key, old=old, new=value)
                applied.append(f"{key}: {old} -> {value}")
                if key.startswith("models.") and key.endswith(".profile"):
                    profile_changes.append((key.split(".", 1)[1].rsplit(".", 1)[0], value or ""))
            else:
                log.warning("config.needs_restart", key=key, old=old, new=value)
        try:
            merged = merge_reloadable(self.cfg, new)
        except msgspec.ValidationError as e:  # e.g. a removed model still names a removed profile
            log.error("config.reload_refused", error=str(e), kept="running config")
            return []
        self.cfg = merged
        self.hub.heartbeat_secs = self.cfg.server.heartbeat_secs
        self.servicer.work.reshare(self.cfg.server)
        # the file's profile wins over a runtime switch
        reconfigure(self.residency, self.cfg, dict(profile_changes))
        log.info("config.reloaded", changed=len(applied))
        return applied

    # ------------------------------------------------------------- SIGTERM

    async def drain(self) -> None:
        """Refuse new work, let in-flight work finish up to drain_secs, stop everything."""
        drain_secs = self.cfg.server.drain_secs
        self.servicer.draining = True
        log.info("neuron.draining", drain_secs=drain_secs)
        await self.residency.cancel_loads()  # a load is not drained: none ends after the stop
        for r in list(self.residency.models.values()):
            if r.client is not None and r.state != ModelState.FAILED:
                r.state = ModelState.DRAINING
                # the engine refuses what it has queued: those callers retry elsewhere now
                r.client.stop_admitting(True, refuse_queued=True)
        self.hub.changed()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_secs
        for r in list(self.residency.models.values()):
            await self.residency.wait_idle(r, max(0.0, deadline - loop.time()))
        left = sum(r.active for r in self.residency.models.values())
        await self.residency.shutdown()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        self.servicer.work.close()  # calls still waiting for it are cancelled
        log.info("neuron.stopped", aborted=left)


def check_plans(config_path: Path, cfg: NeuronConfig) -> None:
    """Plan every model as `helexa plan` does, asking the devices (nvidia-smi) when the config
    gives neither kv_budget_mb nor device_memory_mb; raises PlanError with the arithmetic."""
    from helexa.neuron.eviction import device_memory_mb
    from helexa.plan import UnknownBudget, check_neuron_config, plan_model

    check_neuron_config(config_path, cfg)
    for entry in cfg.models:
        try:
            plan_model(cfg, entry, config_path,
                       device_memory_mb=device_memory_mb(cfg, cfg.devices_of(entry)))
        except UnknownBudget:
            continue  # no figure to plan with: the load will say so for this model alone


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="helexa neuron", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="neuron config (TOML)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging("neuron", args.log_level)
    try:
        cfg = load_neuron_config(args.config)
        check_plans(Path(args.config), cfg)
    except ConfigError as e:  # PlanError is a ConfigError: the message shows the arithmetic
        print(f"helexa neuron: {e}", file=sys.stderr)
        return 2
    log.info("process.fd_limit", **raise_fd_limit())  # each gRPC connection is a descriptor
    return asyncio.run(_serve(Path(args.config), cfg))


async def _serve(config_path: Path, cfg: NeuronConfig) -> int:
    daemon = NeuronDaemon(config_path, cfg)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
    loop.add_signal_handler(signal.SIGTERM, daemon.request_stop)
    loop.add_signal_handler(signal.SIGINT, daemon.request_stop)
    return await daemon.run()
