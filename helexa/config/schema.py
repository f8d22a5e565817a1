"""Typed configuration of the neuron, the router and the model catalogue.

TOML is parsed once, at process entry, into frozen msgspec Structs. Every
field is declared with `field_meta(...)`, which records its meaning and
whether a running daemon applies it on SIGHUP (`reload`) or only at start
(`restart`); docs/config.md is generated from these declarations
(`helexa config doc`). Reading and validating a file is config_load.py's: a
bad file raises `ConfigError` with one line per error, `file: key: what was
expected`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

# The TOML reader and validation live in config_load.py; re-exported for the daemons.
from helexa.config.fields import RELOAD, RESTART, field_meta, optional
from helexa.config.images import ImagesConfig
from helexa.config.load import ConfigError, load_config, read_toml  # noqa: F401

T = TypeVar("T", bound=msgspec.Struct)

KvDtype = Literal["auto", "fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4"]


# "ngram" | "mtp" | "draft:<model id>" | "off"; this build runs all four.
Speculation = str
SPECULATION_BUILT = ("ngram", "mtp", "off")
DRAFT_PREFIX = "draft:"


def draft_model_id(speculation: str | None) -> str | None:
    """The model id a `draft:<model id>` setting names; None for any other setting."""
    if speculation is None or not speculation.startswith(DRAFT_PREFIX):
        return None
    return speculation[len(DRAFT_PREFIX):]


def _check_speculation(value: str, where: str, *, per_model: bool = False) -> None:
    if value in SPECULATION_BUILT:
        return
    draft = draft_model_id(value)
    if draft is not None:
        if not per_model:  # a draft model belongs to one target, which loads it with itself
            raise ValueError(f"{where}: {value!r}: a draft model is set per model, in that "
                             "model's [[models]] speculation (docs/speculation.md)")
        if not draft:
            raise ValueError(f"{where}: expected \"draft:<model id>\" naming a [[models]] "
                             f"entry, got {value!r}")
        return
    raise ValueError(f"{where}: expected \"ngram\", \"mtp\", \"draft:<model id>\" or"
                     f" \"off\", got {value!r}")


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# --------------------------------------------------------------------- neuron


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, field_meta("Name of this neuron (its host), shown to routers.", RESTART)] = "local"
    listen: Annotated[str, field_meta(
        "gRPC listen address host:port; port 0 picks a free port, printed once ready.", RESTART)] = "127.0.0.1:0"
    address_file: Annotated[str | None, field_meta(
        "File the bound gRPC address is written to once ready.", RESTART)] = None
    token_file: Annotated[str | None, field_meta(
        "File holding the shared token callers must present; none = no token required.", RESTART)] = None
    tls_cert_file: Annotated[str | None, field_meta("PEM certificate; with tls_key_file enables TLS.", RESTART)] = None
    tls_key_file: Annotated[str | None, field_meta("PEM private key for tls_cert_file.", RESTART)] = None
    metrics_listen: Annotated[str | None, field_meta(
        "Prometheus HTTP listen address host:port (port 0 allowed); none = no metrics server.", RESTART)] = None
    devices: Annotated[list[str], field_meta(
        "Devices this neuron owns, e.g. [\"cuda:0\", \"cuda:1\"] or [\"cpu\"].", RESTART)] = msgspec.field(
            default_factory=lambda: ["cpu"])
    device_memory_mb: Annotated[optional(int, ge=1), field_meta(
        "Memory of each device in MiB, for planning without a device; none = ask the device.",
        RESTART)] = None
    drain_secs: Annotated[float, field_meta(
        "On SIGTERM or a draining unload, how long in-flight work may finish.", RELOAD, ge=0)] = 30.0
    request_timeout_secs: Annotated[float, field_meta(
        "Deadline of a request that brings none of its own.", RELOAD, gt=0)] = 600.0
    heartbeat_secs: Annotated[float, field_meta(
        "Longest gap between Watch messages when nothing changes.", RELOAD, gt=0)] = 2.0


class AdmissionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_in_flight: Annotated[int, field_meta(
        "Requests holding a KV reservation at once, per model.", RELOAD, ge=1)] = 16
    max_queue_depth: Annotated[int, field_meta(
        "Requests waiting for admission, per model; beyond it 503 overloaded.", RELOAD, ge=0)] = 256
    max_per_principal: Annotated[int, field_meta(
        "Queued + in-flight requests of one principal; beyond it 429.", RELOAD, ge=1)] = 64
    anon_max_in_flight: Annotated[int, field_meta(
        "In-flight requests of anonymous callers together.", RELOAD, ge=0)] = 4
    kv_max_wait_secs: Annotated[float, field_meta(
        "Longest a queued request waits for KV before 503 overloaded.", RELOAD, ge=0)] = 30.0


class KvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    kv_budget_mb: Annotated[optional(int, ge=1), field_meta(
        "KV pool size in MiB per card; none = memory_fraction of the device less weights and headroom.",
        RESTART)] = None
    memory_fraction: Annotated[float, field_meta(
        "Share of device memory helexa may use (weights + KV + headroom) when kv_budget_mb is unset.",
        RESTART, gt=0, le=1)] = 0.9
    block_size: Annotated[int, field_meta("Tokens per KV block (a power of two).", RESTART, ge=1, le=1024)] = 16
    kv_dtype: Annotated[KvDtype, field_meta(
        "KV cache dtype; auto = the model's dtype. Quantised dtypes buy context.", RESTART)] = "auto"
    default_output_tokens: Annotated[int, field_meta(
        "Output budget reserved for a request without max_tokens (capped by the context left).",
        RELOAD, ge=1)] = 1024
    activation_headroom_mb: Annotated[int, field_meta(
        "Memory kept free for activations when the pool is derived from device memory.", RESTART, ge=0)] = 512
    prefix_cache: Annotated[bool, field_meta(
        "Share KV blocks of identical prompt prefixes between requests.", RESTART)] = True

    def __post_init__(self) -> None:
        if not _power_of_two(self.block_size):
            raise ValueError(f"block_size: expected a power of two, got {self.block_size}")


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_slots: Annotated[int, field_meta("Rows in the decode batch (running requests).", RELOAD, ge=1)] = 8
    max_batched_tokens: Annotated[int, field_meta(
        "Token budget of one engine step (decode tokens + prefill chunks).", RELOAD, ge=1)] = 2048
    prefill_chunk_tokens: Annotated[int, field_meta(
        "Largest prefill chunk of one request in one step.", RELOAD, ge=1)] = 512
    torch_threads: Annotated[optional(int, ge=1), field_meta(
        "torch threads of an engine process on CPU; none = torch's default.", RESTART)] = None
    attention_backend: Annotated[Literal["auto", "torch", "cpu", "cuda"], field_meta(
        "Attention backend: auto = cpu on CPU, cuda on a CUDA device when FlashInfer is "
        "installed (pip install -e '.[cuda]'), else torch; torch = plain SDPA reference.",
        RESTART)] = "auto"
    cuda_graphs: Annotated[bool, field_meta(
        "Capture decode steps as CUDA graphs (cuda backend, batch sizes up to max_slots).",
        RESTART)] = True
    speculation: Annotated[Speculation, field_meta(
        "Speculative decoding drafter of every model: ngram (prompt lookup), mtp (the"
        " checkpoint's multi-token-prediction head) or off (docs/speculation.md); a draft"
        " model is set per model (models[].speculation).", RELOAD)] = "off"
    spec_k: Annotated[int, field_meta(
        "Most tokens drafted per request per step.", RELOAD, ge=0, le=16)] = 4
    spec_full_below: Annotated[float, field_meta(
        "Speculate with spec_k while running requests / max_slots is at most this.",
        RELOAD, ge=0, le=1)] = 0.25
    spec_off_above: Annotated[float, field_meta(
        "No speculation once running requests / max_slots reaches this (between the two, k"
        " shrinks linearly).", RELOAD, ge=0, le=1.01)] = 0.75
    spec_min_acceptance: Annotated[float, field_meta(
        "A request whose recent acceptance rate is below this drafts only an occasional probe.",
        RELOAD, ge=0, le=1)] = 0.3
    spec_keep_acceptance: Annotated[float, field_meta(
        "A request whose recent acceptance rate is at least this drafts spec_k at any load"
        " (above 1: never).", RELOAD, ge=0)] = 0.8

    def __post_init__(self) -> None:
        _check_speculation(self.speculation, "engine.speculation")
        if self.spec_off_above < self.spec_full_below:
            raise ValueError(f"engine.spec_off_above: expected >= spec_full_below"
                             f" ({self.spec_full_below}), got {self.spec_off_above}")


class ProfileConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_in_flight: Annotated[optional(int, ge=1), field_meta("Overrides admission.max_in_flight.", RELOAD)] = None
    max_slots: Annotated[optional(int, ge=1), field_meta("Overrides engine.max_slots.", RELOAD)] = None
    max_batched_tokens: Annotated[optional(int, ge=1), field_meta(
        "Overrides engine.max_batched_tokens.", RELOAD)] = None
    kv_dtype: Annotated[KvDtype | None, field_meta(
        "Overrides kv.kv_dtype; switching it re-plans the pool without reloading weights.", RELOAD)] = None
    default_output_tokens: Annotated[optional(int, ge=1), field_meta(
        "Overrides kv.default_output_tokens.", RELOAD)] = None
    speculation: Annotated[Speculation | None, field_meta(
        "Overrides engine.speculation.", RELOAD)] = None
    spec_k: Annotated[optional(int, ge=0), field_meta("Overrides engine.spec_k.", RELOAD)] = None

    def __post_init__(self) -> None:
        if self.speculation is not None:
            _check_speculation(self.speculation, "speculation")


class ModelEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, field_meta("Model id clients ask for, e.g. Qwen/Qwen3-8B.", RESTART)]
    path: Annotated[str | None, field_meta(
        "Checkpoint folder (config.json, *.safetensors, tokenizer), or a .gguf file (or a folder of "
        "one: docs/quantization.md). Relative paths are from the config file.",
        RESTART)] = None
    config: Annotated[str | None, field_meta(
        "config.json used for planning when the weights are not on this machine; default path/config.json.",
        RESTART)] = None
    tp: Annotated[int, field_meta("Tensor-parallel width (devices used).", RESTART, ge=1)] = 1
    devices: Annotated[list[str] | None, field_meta(
        "Devices of this model; none = the first tp devices of the neuron.", RESTART)] = None
    dtype: Annotated[Literal["auto", "fp32", "fp16", "bf16"], field_meta(
        "Weight dtype; auto = the checkpoint's torch_dtype.", RESTART)] = "auto"
    quantize: Annotated[Literal["none", "int8", "int4"], field_meta(
        "Quantise a float checkpoint's weights at load (weight-only): int8 = every linear, the "
        "LM head and the embedding int8, a scale per row; int4 = the decoder's linears int4 in "
        "groups of quant_group_size (scale and zero per group), head and embedding int8. Fast "
        "on CPU with dtype = bf16.", RESTART)] = "none"
    quant_group_size: Annotated[Literal[32, 64, 128, 256], field_meta(
        "int4 group size along each linear's input; under tp a rank's input width must be a "
        "multiple of it.", RESTART)] = 128
    preload: Annotated[bool, field_meta("Load at start rather than on demand.", RESTART)] = True
    priority: Annotated[int, field_meta(
        "Residency priority: eviction takes the least recently used model of equal or lower priority.",
        RELOAD)] = 0
    profile: Annotated[str | None, field_meta("Profile the model runs (a [profiles.NAME]).", RELOAD)] = None
    context: Annotated[optional(int, ge=2), field_meta(
        "Advertised context (prompt + output tokens); the neuron refuses to start if the pool cannot hold it.",
        RESTART)] = None
    max_output_tokens: Annotated[optional(int, ge=1), field_meta(
        "Largest output a request may ask for; none = context - 1.", RESTART)] = None
    kv_budget_mb: Annotated[optional(int, ge=1), field_meta(
        "This model's KV pool in MiB per card; overrides kv.kv_budget_mb.", RESTART)] = None
    tool_parser: Annotated[Literal["auto", "hermes", "llama3_json", "none"], field_meta(
        "How the model writes tool calls: hermes = <tool_call>{json}</tool_call> (Qwen), llama3_json = a bare JSON object; auto = read from the chat template.",
        RESTART)] = "auto"
    reasoning_parser: Annotated[Literal["auto", "think", "none"], field_meta(
        "How the model writes its thought: think = <think>...</think>; auto = read from the chat template.",
        RESTART)] = "auto"
    thinking_budget_tokens: Annotated[int, field_meta(
        "Most tokens a thought may take at reasoning_effort high (and by default); medium is half, low an eighth; then the engine closes the thought.",
        RELOAD, ge=0)] = 4096
    # Speculation per model: over [engine], under the profile the model runs (docs/speculation.md).
    speculation: Annotated[Speculation | None, field_meta(
        "This model's drafter, over engine.speculation: ngram, off, or draft:<model id> (a "
        "smaller [[models]] entry of the same tokenizer, loaded with this model at tp = 1; its "
        "weights and KV count in this model's plan). A profile's speculation overrides it.",
        RELOAD)] = None
    spec_k: Annotated[optional(int, ge=0, le=16), field_meta(
        "Overrides engine.spec_k for this model (a profile's spec_k overrides it).", RELOAD)] = None
    spec_full_below: Annotated[optional(float, ge=0.0, le=1.0), field_meta(
        "Overrides engine.spec_full_below for this model.", RELOAD)] = None
    spec_off_above: Annotated[optional(float, ge=0.0, le=1.01), field_meta(
        "Overrides engine.spec_off_above for this model.", RELOAD)] = None
    spec_min_acceptance: Annotated[optional(float, ge=0.0, le=1.0), field_meta(
        "Overrides engine.spec_min_acceptance for this model.", RELOAD)] = None
    spec_keep_acceptance: Annotated[optional(float, ge=0.0), field_meta(
        "Overrides engine.spec_keep_acceptance for this model.", RELOAD)] = None

    def __post_init__(self) -> None:
        if self.path is None and self.config is None:
            raise ValueError("expected `path` or `config` (a checkpoint folder or its config.json)")
        if self.speculation is not None:
            _check_speculation(self.speculation, "speculation", per_model=True)
            if draft_model_id(self.speculation) is not None and self.tp > 1:
                raise ValueError(f"speculation: a draft model runs beside its target at tp = 1 "
                                 f"only (docs/speculation.md), got tp = {self.tp}")
        if self.devices is not None and len(self.devices) != self.tp:
            raise ValueError(f"devices: expected {self.tp} devices for tp = {self.tp}, got {len(self.devices)}")


class NeuronConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    models: list[ModelEntry] = msgspec.field(default_factory=list)
    profiles: dict[str, ProfileConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if m.id in seen:
                raise ValueError(f"models[{i}].id: expected unique model ids, `{m.id}` repeats")
            seen.add(m.id)
            draft = draft_model_id(m.speculation)
            if draft is not None and not any(d.id == draft and d.path for d in self.models):
                raise ValueError(f"models[{i}].speculation: expected draft:<model id> naming a "
                                 f"[[models]] entry with a `path`, got `{m.speculation}`")
            if m.profile is not None and m.profile not in self.profiles:
                names = ", ".join(sorted(self.profiles)) or "none defined"
                raise ValueError(f"models[{i}].profile: expected one of the [profiles.*] ({names}),"
                                 f" got `{m.profile}`")

    def model(self, model_id: str) -> ModelEntry:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)


# --------------------------------------------------------------------- router


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
        "that stops arriving for this long is answered 408 and closed.", RESTART, gt=0)] = 15.0


class AuthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    keys_file: Annotated[str | None, field_meta(
        "TOML file mapping hashed API keys to principals (see docs/operating.md).", RELOAD)] = None
    require_auth: Annotated[bool, field_meta(
        "Refuse callers without a known key (401) instead of serving them anonymously.", RELOAD)] = False
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
        "How long a request waits for an on-demand model load before 503 model_loading.", RELOAD, ge=0)] = 60.0
    unhealthy_after_secs: Annotated[float, field_meta(
        "A neuron whose Watch stream is silent this long leaves rotation.", RELOAD, gt=0)] = 2.0
    reconnect_max_secs: Annotated[float, field_meta(
        "Longest backoff between Watch reconnects.", RELOAD, gt=0)] = 5.0
    first_report_secs: Annotated[float, field_meta(
        "How long a neuron link just opened (at start or on reload) may take to bring its first "
        "Watch report: the router waits this long before it prints that it is listening, and a "
        "request that arrives meanwhile waits for the report instead of a 503 at once.",
        RELOAD, ge=0)] = 5.0
    stream_idle_secs: Annotated[float, field_meta(
        "A stream whose neuron sends no message for this long after its first one is ended "
        "with an upstream_error event (a hung host). Calls on a neuron that leaves rotation "
        "(unhealthy_after_secs) are ended at once.", RELOAD, gt=0)] = 30.0


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: RouterServerConfig = msgspec.field(default_factory=RouterServerConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    neurons: NeuronsConfig = msgspec.field(default_factory=NeuronsConfig)
    aliases: Annotated[dict[str, str], field_meta(
        "Alias → model id, e.g. \"helexa/balanced\" = \"Qwen/Qwen3-8B\".", RELOAD)] = msgspec.field(
            default_factory=dict)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    images: ImagesConfig = msgspec.field(default_factory=ImagesConfig)


# ------------------------------------------------------------------ catalogue


class CatalogueModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, field_meta("Model id.", RELOAD)]
    config: Annotated[str, field_meta("Path of its config.json (relative to the catalogue file).", RELOAD)]
    description: Annotated[str, field_meta("What it is and why it is here.", RELOAD)] = ""
    weights_gb: Annotated[float | None, field_meta("Size of the weights on disk, for reference.", RELOAD)] = None
    quantize: Annotated[Literal["none", "int8", "int4"], field_meta(
        "How a neuron serves it: quantised at load as models[].quantize; weights_gb is then "
        "what it holds.", RELOAD)] = "none"


class ModelsCatalogue(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    models: list[CatalogueModel] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------- loading

SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "neuron": NeuronConfig,
    "router": RouterConfig,
    "models": ModelsCatalogue,
}


def detect_kind(path: str | Path) -> str:
    """Which schema a file uses, from its location or its top-level keys."""
    p = Path(path)
    if p.name == "router.toml" or "router" in p.stem:
        return "router"
    if p.name == "models.toml":
        return "models"
    return "neuron"


def load_neuron_config(path: str | Path) -> NeuronConfig:
    return load_config(path, NeuronConfig)


def load_router_config(path: str | Path) -> RouterConfig:
    return load_config(path, RouterConfig)


def resolve_path(config_file: str | Path, value: str) -> Path:
    """A path from a config file, relative to the file's folder."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (Path(config_file).resolve().parent / p)


def read_secret(config_file: str | Path, value: str | None) -> str | None:
    """The stripped contents of a secret file named in a config (never logged)."""
    if value is None:
        return None
    return resolve_path(config_file, value).read_text().strip()


def to_plain(cfg: msgspec.Struct) -> dict[str, Any]:
    """The effective config as plain data (defaults filled, None dropped) for tomli-w."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(msgspec.to_builtins(cfg))


def field_apply(schema: type[msgspec.Struct], dotted: str) -> str:
    """`reload` or `restart` for a dotted key such as `admission.max_in_flight`."""
    info = msgspec.inspect.type_info(schema)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        while isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.DictType)):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.value_type
        if not isinstance(info, msgspec.inspect.StructType):
            break
        field = next((f for f in info.fields if f.name == part), None)
        if field is None:
            raise KeyError(dotted)
        t = field.type
        if isinstance(t, msgspec.inspect.Metadata) and t.extra and "apply" in t.extra:
            if i == len(parts) - 1 or not _is_struct(t.type):
                return t.extra["apply"]
        info = t.type if isinstance(t, msgspec.inspect.Metadata) else t
        if isinstance(info, msgspec.inspect.UnionType):
            info = next((x for x in info.types if not isinstance(x, msgspec.inspect.NoneType)), info)
    return RESTART


def _is_struct(t: Any) -> bool:
    return isinstance(t, msgspec.inspect.StructType)
