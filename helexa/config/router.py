"""The router's config (asset/router.toml): its server, auth, the neurons it forwards to,
model aliases, timeouts and the per-request limits."""

from __future__ import annotations

import json
import re
from typing import Annotated

import msgspec

from helexa.config.fields import RELOAD, RESTART, field_meta, optional
from helexa.config.images import ImagesConfig


class RouterServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    listen: Annotated[str, field_meta(
        "HTTP listen address host:port; port 0 picks a free port, printed once ready.", RESTART)] = "127.0.0.1:8080"
    address_file: Annotated[str | None, field_meta(
        "File the bound HTTP address is written to once ready.", RESTART)] = None
    max_body_bytes: Annotated[int, field_meta(
        "Largest request body accepted; beyond it 413.", RESTART, ge=1024)] = 8 * 1024 * 1024
    read_timeout_secs: Annotated[float, field_meta(
        "A connection that sends no byte of a request's headers for this long (from its "
        "opening or its last response: also the keep-alive idle time) is closed, and a body "
        "that stops arriving for this long, or arrives slower than 8 KiB/s after it, is "
        "answered 408 and closed.", RESTART, gt=0)] = 15.0
    max_connections: Annotated[optional(int, ge=1), field_meta(
        "Client connections the router holds open at once; one more is answered at once "
        "with 503 too_many_connections, its request unread, and closed, while those open "
        "(and their streams) go on (docs/http.md, \"Connections\"). Unset = the process's "
        "file-descriptor limit (its soft RLIMIT_NOFILE, which the router raises to the hard "
        "limit at start, logging both: process.fd_limit) minus a reserve for the router's "
        "own files (neuron links, logs, the keys file, refusals being answered) of half the "
        "limit, at most 512: 19,488 under a limit of 20,000, 512 under 1,024. A figure the "
        "limit cannot hold so is refused, at start and on reload, with the arithmetic.",
        RELOAD)] = None
    max_connections_per_address: Annotated[optional(int, ge=1), field_meta(
        "Client connections one client address (IP) may hold open at once; one more is "
        "answered as one over max_connections is. Unset = no cap per address (a proxy in "
        "front of the router is one address: set it only where clients connect directly).",
        RELOAD)] = None
    cors_allowed_origins: Annotated[list[str], field_meta(
        "Browser origins (`scheme://host[:port]`) whose pages may call the API: their CORS "
        "preflights are answered without a key and every reply carries "
        "Access-Control-Allow-Origin; \"*\" = any page. None by default (vLLM allows any): "
        "a router serving callers without a key would serve every web page its users open "
        "(docs/http.md, \"CORS\").", RELOAD)] = msgspec.field(default_factory=list)


class AuthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    keys_file: Annotated[str | None, field_meta(
        "TOML file mapping hashed API keys to principals (see docs/operating.md).", RELOAD)] = None
    require_auth: Annotated[bool, field_meta(
        "Refuse callers without a key (401) instead of serving them anonymously. A key the "
        "keys file does not hold is a 401 either way (without a keys_file: with this off, "
        "any key is anonymous).", RELOAD)] = False
    load_principals: Annotated[list[str], field_meta(
        "Principals that may cause an on-demand model load (and so evict another); none by "
        "default. \"*\" = anyone, \"anonymous\" = callers without a key.",
        RELOAD)] = msgspec.field(default_factory=list)


class NeuronEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, field_meta("Name of the neuron (labels metrics and logs).", RELOAD)]
    address: Annotated[str, field_meta("gRPC address host:port of the neuron.", RELOAD)]
    tls: Annotated[bool, field_meta("Connect with TLS.", RELOAD)] = False
    ca_file: Annotated[str | None, field_meta("PEM CA bundle for TLS; none = system roots.", RELOAD)] = None


class NeuronsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    token_file: Annotated[str | None, field_meta(
        "File holding the token presented to neurons.", RELOAD)] = None
    endpoints: Annotated[list[NeuronEndpoint], field_meta(
        "The neurons this router forwards to.", RELOAD)] = msgspec.field(default_factory=list)


class TimeoutsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    request_secs: Annotated[float, field_meta(
        "Deadline given to a request (passed to the neuron).", RELOAD, gt=0)] = 600.0
    load_wait_secs: Annotated[float, field_meta(
        "How long a request waits for an on-demand model load (503 model_loading) or a profile "
        "switch (503 service_unavailable), at most until its own deadline.", RELOAD, ge=0)] = 60.0
    unhealthy_after_secs: Annotated[float, field_meta(
        "A neuron whose Watch stream is silent this long leaves rotation: no new work goes "
        "there; the calls already there go on (stream_idle_secs bounds them).", RELOAD,
        gt=0)] = 2.0
    reconnect_max_secs: Annotated[float, field_meta(
        "Longest backoff between Watch reconnects.", RELOAD, gt=0)] = 5.0
    keepalive_secs: Annotated[float, field_meta(
        "The router pings a neuron's connection (an HTTP/2 PING) after this long without a "
        "byte from it. gRPC's own I/O threads answer pings, so a neuron whose Python is busy "
        "for seconds (a large prefill) still answers; a hung host (SIGSTOP, a frozen VM, a "
        "pulled cable) does not, and keepalive_timeout_secs later its connection is closed: "
        "its streams end with an upstream_error event (a call before its first token is "
        "retried on another neuron) and it leaves rotation, within about keepalive_secs + "
        "keepalive_timeout_secs rather than stream_idle_secs. A neuron accepts pings every "
        "0.5 s (docs/architecture.md, \"Status: Watch\").", RELOAD, ge=1)] = 2.0
    keepalive_timeout_secs: Annotated[float, field_meta(
        "How long a neuron may take to answer the router's ping (keepalive_secs) before its "
        "connection is counted dead and closed, with every call on it.", RELOAD, ge=0.5)] = 3.0
    first_report_secs: Annotated[float, field_meta(
        "How long a neuron link just opened (at start or on reload) may take to bring its first "
        "Watch report: the router waits this long before it prints that it is listening, and a "
        "request that arrives meanwhile waits for the report instead of a 503 at once.",
        RELOAD, ge=0)] = 5.0
    stream_idle_secs: Annotated[float, field_meta(
        "A stream whose neuron sends no token for this long after its last one is ended "
        "with an upstream_error event (a neuron that answers keepalive pings but sends "
        "nothing, a wedged engine; a hung host is found sooner: keepalive_secs); the time the router itself does not read, "
        "its client's socket being full, does not count. Before the first token the bound is this "
        "plus four times the prompt's prefill at the model's measured rate, from when the "
        "neuron gives the request a batch row, so a long prompt, or a wait for a row, is "
        "not cut; nor is a wait for a row after tokens flowed, which the neuron says "
        "(waiting_for_row: resumed after a pause behind a full batch), bounded by the "
        "request's deadline. A call with no such clock (a non-streaming call, a stream queued "
        "or waiting for a row) is ended once its neuron's Watch has been silent this long and "
        "it left rotation (unhealthy_after_secs); leaving rotation alone ends no call. A "
        "call ended so before its first token is retried once on another neuron "
        "(docs/errors.md).",
        RELOAD, gt=0)] = 30.0
    client_write_secs: Annotated[float, field_meta(
        "A stream whose client takes nothing of what waits for it for this long (the router's "
        "bounded send buffer stays full) while requests wait for admission behind it (as for "
        "client_min_bytes_per_sec; with nobody waiting: client_idle_secs), or a whole reply's "
        "client, is ended and its neuron call cancelled, which returns the request's KV; the "
        "window client_min_bytes_per_sec is measured over.",
        RELOAD, gt=0)] = 30.0
    client_idle_secs: Annotated[float, field_meta(
        "A stream whose client takes nothing of what waits for it for this long while nobody "
        "waits behind it is ended (at least client_write_secs). Its request is paused meanwhile "
        "and its KV costs nobody anything; once a request waits, client_write_secs and "
        "client_min_bytes_per_sec apply at once. A slow reader's TCP shows its taking in "
        "steps (the openai SDK on loopback: 95,232 bytes, 28-38 s apart at 3.4 KB/s), so at "
        "the default a reader of 320 bytes a second or more is never ended for taking "
        "nothing while nobody waits (it was at 30 s).",
        RELOAD, gt=0)] = 300.0
    client_min_bytes_per_sec: Annotated[float, field_meta(
        "While requests wait for admission behind a stream (its model on its neuron has "
        "requests queued, or the router holds requests for the model), a client that was "
        "behind it (over 64 KiB waiting) all of the last client_write_secs must have taken "
        "this many bytes a second of it, less one 64 KiB step (a slow reader's TCP "
        "acknowledges in such steps), or it is ended; with nobody waiting a slow reader is "
        "only paced, never ended for it. A whole reply's client is held to it always. 0: "
        "only taking nothing ends a client. The default is a 32 kbit/s link's: a client on a "
        "slow mobile link (2G EDGE, 25 KB/s) takes several times this, one doing 50 ms of "
        "work on each chunk of a plain token stream takes about 3 KB/s (under it: ended only "
        "while others wait), and a trickle of 200 bytes every 18 s is a 300th of it.",
        RELOAD, ge=0)] = 4096.0


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_tools: Annotated[int, field_meta(
        "Most tools one request may declare (OpenAI's own limit is 128); beyond it 400.",
        RELOAD, ge=1)] = 128
    max_schema_bytes: Annotated[int, field_meta(
        "Most bytes of JSON schema (as compact JSON) one request's tools may carry together, "
        "and its response schema alone; beyond it 400.", RELOAD, ge=1024)] = 512 * 1024
    max_pattern_chars: Annotated[int, field_meta(
        "Longest regular expression (a `pattern` or a `patternProperties` key) a schema may "
        "hold; beyond it 400.", RELOAD, ge=16)] = 4096
    max_grammar_bytes: Annotated[int, field_meta(
        "Largest Lark grammar (a Responses custom tool's format.definition, in UTF-8 bytes) "
        "a request may carry; beyond it 400. Compiling one grows faster than its size "
        "(40,000 alternatives, 429 KB: 5 CPU s).", RELOAD, ge=1024)] = 64 * 1024
    schema_workers: Annotated[int, field_meta(
        "Threads that parse request bodies, off the event loop that carries every stream and "
        "the neurons' reports.", RESTART, ge=1)] = 2
    schema_queue_depth: Annotated[int, field_meta(
        "Requests that may wait for a schema worker, and again for a compile worker; beyond "
        "it 503 overloaded.", RESTART, ge=0)] = 64
    compile_workers: Annotated[int, field_meta(
        "Threads that compile a request's grammars (a response schema, a forced tool "
        "choice's schemas, a custom tool's grammar) once its body is parsed: a pool of their "
        "own, so a schema that takes seconds never keeps another body from being parsed. "
        "Shared as the schema workers are (schema_per_principal, round robin).",
        RESTART, ge=1)] = 2
    schema_per_principal: Annotated[optional(int, ge=1), field_meta(
        "Tasks of one principal (an API key's; callers without a key are one principal) that "
        "may be running on the schema workers or waiting for one (parsing a body, checking its "
        "images, building its neuron requests, /tokenize), and again on the compile workers; "
        "beyond it that principal gets 429 rate_limit_exceeded "
        "while others still get in, and waiting tasks are served round robin between "
        "principals. Unset = a quarter of schema_workers + schema_queue_depth (16 by default); "
        "with no auth.keys_file, where every caller is the one anonymous principal, all of "
        "them.",
        RELOAD)] = None


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: RouterServerConfig = msgspec.field(default_factory=RouterServerConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    neurons: NeuronsConfig = msgspec.field(default_factory=NeuronsConfig)
    aliases: Annotated[dict[str, str], field_meta(
        "Alias → model id, e.g. \"helexa/balanced\" = \"Qwen/Qwen3-8B\"; the id may not be "
        "another alias or the alias itself (one hop).", RELOAD)] = msgspec.field(
            default_factory=dict)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    images: ImagesConfig = msgspec.field(default_factory=ImagesConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        problem = alias_problem(self.aliases)
        if problem:
            raise ValueError(problem)
        names = [e.name for e in self.neurons.endpoints]
        for i, name in enumerate(names):
            if name in names[:i]:  # metrics, logs and the status page name a neuron by it
                raise ValueError(f"neurons.endpoints[{i}].name: expected unique neuron names, "
                                 f"`{name}` repeats")


def alias_problem(table: dict[str, str]) -> str:
    """Why an alias table cannot be served ("" when it can): an alias names a model id, never
    another alias nor itself (one hop keeps `/v1/models` and error messages unambiguous).
    The router refuses such a file at start and on reload, and `helexa config check` and
    `helexa deploy` with it, all through RouterConfig."""
    for alias, target in table.items():
        key = f"aliases.{toml_key(alias)}"
        if target == alias:
            return f"{key}: points at itself; expected a model id"
        if target in table:
            return f"{key}: points at another alias `{target}`; expected a model id"
    return ""


def toml_key(name: str) -> str:
    """A table key as TOML writes it: bare when it can be, else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)
