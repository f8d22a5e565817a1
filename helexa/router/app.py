"""`helexa router --config FILE`: the OpenAI-compatible HTTP front door.

Builds the aiohttp application (the generation endpoints in `serve.py`,
`/v1/models`, `/health`, `/metrics`, and `/status` + `/status.json` from
`status.py`), starts the neuron registry, prints
`ROUTER LISTENING http://HOST:PORT` once bound (port 0 allowed) and writes
`server.address_file`. SIGHUP re-reads the config and applies what can be
applied live (aliases, keys, auth policy, neuron list, timeouts) without
dropping requests; SIGTERM or SIGINT stops it, letting in-flight requests end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from helexa.config.diff import changes
from helexa.config.schema import (
    RESTART,
    ConfigError,
    RouterConfig,
    load_router_config,
    read_secret,
    resolve_path,
)
from helexa.fd_limit import raise_fd_limit
from helexa.log import get_logger, setup_logging
from helexa.router import cors, fleet_view, serve, tokenize
from helexa.router.aliases import Aliases
from helexa.router.auth import Authenticator, load_keys_file
from helexa.router.client_stream import Pace
from helexa.router.conn_gate import ConnectionGate, check_caps
from helexa.router.dispatch import Dispatcher, DispatchSettings
from helexa.router.errors import ApiError
from helexa.router.http_edge import RouterRunner
from helexa.router.metrics import CONTENT_TYPE, RouterMetrics
from helexa.router.neuron_channel import ChannelSettings
from helexa.router.registry import Registry
from helexa.router.request_caps import RequestCaps
from helexa.router.status import StatusBoard, status_routes
from helexa.router.work_pool import WorkPool, default_share, log_background_failure

SHUTDOWN_GRACE_SECS = 10.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STATE = serve.STATE


class RouterState:
    """Everything the handlers share; one per process (or per in-process test router)."""

    def __init__(self, cfg: RouterConfig, config_path: Path | None) -> None:
        self.config_path = config_path
        self.started = cfg  # what the restart fields run with until a restart (reload)
        self.log = get_logger("router")
        self.registry = Registry([], token=None, unhealthy_after_secs=2.0, reconnect_max_secs=5.0)
        self.metrics = RouterMetrics(lambda: list(self.registry.links.values()))
        self.connections = ConnectionGate(self.metrics)  # server.max_connections (conn_gate.py)
        self.dispatcher = Dispatcher(self.registry, self.metrics, DispatchSettings(["*"], 60, 600))
        self.status = StatusBoard(self.registry, self.metrics.refusals, self.metrics.requests,
                                  self.metrics.in_progress, self.dispatcher.held)
        self.max_body_bytes = cfg.server.max_body_bytes
        self.models_created: dict[str, int] = {}  # /v1/models' `created` (fleet_view.created)
        self.read_timeout_secs = cfg.server.read_timeout_secs
        # Body parsing and schema work, off this loop (work_pool.py); its size needs a restart,
        # its share per principal does not.
        self.work_pool = WorkPool(cfg.limits.schema_workers, cfg.limits.schema_queue_depth)
        self.work_pool.on_refuse = self._work_refused
        # Compiling a parsed request's grammars: a pool of its own (agent_request.py).
        self.compile_pool = WorkPool(cfg.limits.compile_workers, cfg.limits.schema_queue_depth,
                                     compiling=True)
        self.compile_pool.on_refuse = self._compile_refused
        self.work_pool.on_background_error = self._background_failed
        self.metrics.work_tasks.set_function(lambda: self.work_pool.tasks)
        self.metrics.work_principals.set_function(lambda: self.work_pool.principals)
        self.metrics.work_background.set_function(lambda: self.work_pool.background)
        self.metrics.compile_tasks.set_function(lambda: self.compile_pool.tasks)
        self.apply(cfg)

    def apply(self, cfg: RouterConfig) -> None:
        """Take the reloadable parts of a config (raises ConfigError before changing anything)."""
        self._commit(cfg, *self._build(cfg))

    def _build(self, cfg: RouterConfig) -> tuple[dict[str, str], str | None, Aliases]:
        """Everything a config needs that can fail (files read)."""
        base = self.config_path or Path("router.toml")
        try:
            keys = load_keys_file(resolve_path(base, cfg.auth.keys_file)) if cfg.auth.keys_file \
                else {}
            token = read_secret(base, cfg.neurons.token_file)
        except OSError as e:
            raise ConfigError(f"{base}: cannot read {e.filename}: {e.strerror}") from None
        check_caps(cfg.server.max_connections)
        return keys, token, Aliases(cfg.aliases)  # RouterConfig checked the table

    def _commit(self, cfg: RouterConfig, keys: dict[str, str], token: str | None,
                aliases: Aliases) -> None:
        """Apply what _build made; nothing here can fail."""
        self.cfg = cfg
        self.connections.configure(cfg.server)
        self.auth = Authenticator(keys, cfg.auth.require_auth)
        self.aliases = aliases
        self.request_secs = cfg.timeouts.request_secs
        self.client_pace = Pace(cfg.timeouts.client_write_secs,
                                cfg.timeouts.client_min_bytes_per_sec,
                                idle_secs=cfg.timeouts.client_idle_secs)
        self.caps = RequestCaps.of(cfg.limits)
        for pool in (self.work_pool, self.compile_pool):
            # without keys every caller is the one principal: all of it
            pool.per_principal = cfg.limits.schema_per_principal or (
                default_share(pool.workers, pool.queue_depth) if keys
                else pool.workers + pool.queue_depth)
            # with keys one principal leaves a thread to the others: another key's parse never
            # waits for its slow ones to finish (work_pool.py)
            pool.max_running = max(1, pool.workers - 1) if keys else pool.workers
        self.dispatcher.settings = DispatchSettings(
            list(cfg.auth.load_principals), cfg.timeouts.load_wait_secs, cfg.timeouts.request_secs)
        self.registry.token = token
        self.registry.config_file = self.config_path or Path("router.toml")
        self.registry.unhealthy_after_secs = cfg.timeouts.unhealthy_after_secs
        self.registry.reconnect_max_secs = cfg.timeouts.reconnect_max_secs
        self.registry.channel = ChannelSettings.of(cfg.timeouts)
        self.registry.first_report_secs = cfg.timeouts.first_report_secs
        self.registry.stream_idle_secs = cfg.timeouts.stream_idle_secs

    def _work_refused(self, reason: str, principal: str, pool: str = "parse") -> None:
        """The work pool (`pool` "parse") or the compile pool ("compile") refused a principal's
        task (429 over its share, 503 full)."""
        counter = self.metrics.compile_refusals if pool == "compile" else self.metrics.work_refusals
        counter.labels(reason).inc()
        refusing = self.compile_pool if pool == "compile" else self.work_pool
        self.log.info("router.work_refused", principal=principal, reason=reason, pool=pool,
                      principal_tasks=refusing.tasks_of(principal), tasks=refusing.tasks,
                      share=refusing.per_principal, compile_tasks=self.compile_pool.tasks)

    def _compile_refused(self, reason: str, principal: str) -> None:
        self._work_refused(reason, principal, "compile")

    def _background_failed(self, principal: str, task: str, error: BaseException) -> None:
        """Background work on the pool raised (a bug): counted, and logged with its traceback."""
        self.metrics.work_background_failures.inc()
        log_background_failure(principal, task, error)

    async def reload(self) -> None:
        """SIGHUP: all or nothing. Every part of the new config (keys, token, aliases, every
        new neuron link with its TLS files) is built first; only when all of it succeeded does
        it replace the running one, so a bad file leaves the old links serving."""
        if self.config_path is None:
            return
        try:
            cfg = load_router_config(self.config_path)
            built = self._build(cfg)
            links = self.registry.build_links(cfg.neurons.endpoints, config_file=self.config_path,
                                              channel=ChannelSettings.of(cfg.timeouts))
        except ConfigError as e:
            self.log.error("config.reload_refused", error=str(e), kept="running config")
            return
        self._commit(cfg, *built)
        self.registry.swap_links(links)
        # against what it started with: a second reload still names what waits
        if waiting := [c.key for c in changes(RouterConfig, self.started, cfg)
                       if c.apply == RESTART]:
            self.log.warning("config.restart_needed", fields=waiting)  # the rest applied
        self.log.info("config.reloaded", neurons=[e.name for e in cfg.neurons.endpoints],
                      aliases=len(cfg.aliases))


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error, including aiohttp's own 404/405/413, in the OpenAI envelope."""
    try:
        return await handler(request)
    except ApiError as e:
        return serve.error_response(_api_of(request), e, {})
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            e.status, "invalid_request_error")
        message = e.reason
        if e.status == 404:
            message = f"No endpoint {request.method} {request.path}; see docs/api.md"
        elif e.status == 405:
            message = f"{request.path} does not take {request.method}"
        return serve.error_response(_api_of(request), ApiError(e.status, message, code=code), {})
    except Exception:  # a bug of ours still answers in the envelope
        request.app[STATE].log.exception("http.handler_failed", path=request.path)
        return serve.error_response(_api_of(request), ApiError(
            500, "internal error; the router's log has the details", code="internal_error"), {})


def _api_of(request: web.Request) -> str:
    """Whose error envelope a request gets: Anthropic's under /v1/messages and on
    /v1/models for Anthropic's SDK (its `anthropic-version` header), else OpenAI's."""
    anthropic = request.path.startswith("/v1/messages") or (
        request.path.startswith("/v1/models") and "anthropic-version" in request.headers)
    return "messages" if anthropic else "openai"


async def models(request: web.Request) -> web.Response:
    state: RouterState = request.app[STATE]
    state.auth.of(request.headers)  # 401 when auth is required
    limits = fleet_view.ready_limits(state.registry)
    costs = fleet_view.ready_state_costs(state.registry)
    drafters = fleet_view.drafters(state.registry)
    seeing = fleet_view.models_taking_images(state.registry)
    sharing = fleet_view.prefix_sharing(state.registry)
    created = fleet_view.created(state.registry, state.models_created)

    def entry(model_id: str, target: str) -> dict[str, Any]:
        context, input_, output = limits[target]
        limit: dict[str, int] = {"context": context, "input": input_, "output": output}
        e: dict[str, Any] = {"id": model_id, "object": "model", "created": created[target],
                             "owned_by": "helexa", "limit": limit,
                             "max_model_len": context,  # vLLM's name for the context limit
                             "speculation": drafters.get(target, "off"),
                             "input_modalities": ["text", "image"] if target in seeing
                             else ["text"]}
        fixed, cache = costs.get(target, (0, True))
        if fixed:  # hybrid models: state reserved per request beside the KV tokens
            limit["fixed_bytes_per_request"] = fixed
            e["prefix_cache"] = cache  # on with state snapshots: see docs/architecture.md
        if cache:  # whose cached prefixes a request reuses (kv.prefix_sharing)
            e["prefix_sharing"] = sharing.get(target, "global")
        if model_id != target:
            e["alias_of"] = target
        return e

    data = [entry(m, m) for m in sorted(limits)]
    data += [entry(a, t) for a, t in state.aliases.items() if t in limits]
    anthropic_client = "anthropic-version" in request.headers
    if anthropic_client:  # Anthropic's SDK reads its own shape (type, display_name, ...)
        data = [{**e, "type": "model", "display_name": e["id"],
                 "created_at": fleet_view.rfc3339(e["created"]), "lifecycle": "active",
                 "max_input_tokens": e["limit"]["input"], "max_tokens": e["limit"]["output"]}
                for e in data]
    if "model" in request.match_info:
        found = next((e for e in data if e["id"] == request.match_info["model"]), None)
        if found is None:
            raise ApiError(404, f"The model `{request.match_info['model']}` does not exist",
                           code="model_not_found", param="model")
        return web.json_response(found)
    if anthropic_client:
        return web.json_response(fleet_view.anthropic_page(data, request.query))
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    state: RouterState = request.app[STATE]
    neurons = {name: {"healthy": link.healthy(),
                      "models": [m.model for m in link.status.models] if link.status else []}
               for name, link in state.registry.links.items()}
    ok = any(n["healthy"] for n in neurons.values())
    return web.json_response({"status": "ok" if ok else "no_healthy_neuron", "neurons": neurons},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state: RouterState = request.app[STATE]
    return web.Response(body=await state.metrics.render_off_loop(),
                        headers={"Content-Type": CONTENT_TYPE})


def build_app(state: RouterState) -> web.Application:
    app = web.Application(middlewares=[error_envelope], client_max_size=state.max_body_bytes)
    app[STATE] = state
    cors.install(app, lambda r: r.app[STATE].cfg.server.cors_allowed_origins)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await serve.handle(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await serve.handle(request, "completion")

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)

    async def messages(request: web.Request) -> web.StreamResponse:
        return await serve.handle(request, "messages")

    app.router.add_post("/v1/messages", messages)

    async def responses(request: web.Request) -> web.StreamResponse:
        return await serve.handle(request, "responses")

    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages/count_tokens", tokenize.count_tokens)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/version", tokenize.version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_routes(status_routes(
        lambda r: r.app[STATE].status,
        lambda r: r.app[STATE].auth.of(r.headers)))
    return app


async def start(cfg: RouterConfig, config_path: Path | None = None
                ) -> tuple[web.AppRunner, RouterState, str]:
    """Start a router in this event loop; returns (runner, state, "host:port")."""
    state = RouterState(cfg, config_path)
    await state.registry.start()
    await state.registry.set_endpoints(cfg.neurons.endpoints)
    state.status.start()
    runner = RouterRunner(build_app(state), write_secs=lambda: state.client_pace.window_secs,
                          gate=state.connections,
                          handler_cancellation=True, access_log=None,
                          shutdown_timeout=SHUTDOWN_GRACE_SECS,
                          keepalive_timeout=cfg.server.read_timeout_secs,
                          # after a 408/413, the unread body is drained at most this long
                          lingering_time=cfg.server.read_timeout_secs)
    await runner.setup()
    host, _, port = cfg.server.listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port),
                       backlog=state.connections.backlog)  # the fd reserve holds a burst
    await site.start()
    bound = runner.addresses[0]
    return runner, state, f"{bound[0]}:{bound[1]}"


async def stop(runner: web.AppRunner, state: RouterState) -> None:
    await runner.cleanup()
    state.log.info("router.http_closed")
    await state.dispatcher.close()
    await state.status.close()
    await state.registry.close()
    state.work_pool.close()
    state.compile_pool.close()
    state.log.info("router.stopped")


async def _serve(cfg: RouterConfig, config_path: Path) -> None:
    runner, state, address = await start(cfg, config_path)
    # Bound, but not "listening" until each neuron has spoken (or failed to) once: a client
    # told to go ahead must not meet a router that knows no neuron yet.
    await state.registry.wait_first_tries()
    if cfg.server.address_file:
        path = resolve_path(config_path, cfg.server.address_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(address + "\n")
        os.replace(tmp, path)  # readers never see half an address
    state.log.info("router.listening", address=address, neurons=len(cfg.neurons.endpoints))
    print(f"ROUTER LISTENING http://{address}", flush=True)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(state.reload()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    state.log.info("router.stopping")
    await stop(runner, state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="helexa router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="router TOML config file")
    parser.add_argument("--log-level", default=os.environ.get("HELEXA_LOG_LEVEL", "info"))
    args = parser.parse_args(argv)
    # grpc.aio hands completions over from its poller thread: a short GIL switch interval
    # lets it through sooner (the default 5 ms shows up as tail latency on every call).
    sys.setswitchinterval(0.0005)
    setup_logging("router", args.log_level)
    try:
        cfg = load_router_config(args.config)
        # before the router starts: server.max_connections' default follows it
        get_logger("router").info("process.fd_limit", **raise_fd_limit())
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(cfg, Path(args.config)))
    except (ConfigError, OSError) as e:
        print(f"helexa router: {e}", file=sys.stderr)
        return 1
    return 0
