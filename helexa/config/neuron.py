"""The neuron's config (asset/neuron/<host>.toml): server, admission, KV pool, engine, the
models it serves and the profiles they switch between.

Runtime (reload) keys of [admission], [kv] and [engine] are what a model's engine runs
under (helexa/neuron/engine/messages.py Limits, by the same names); a [[models]] entry
and a [profiles.NAME] table override some of them for one model.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from helexa.config.fields import RELOAD, RESTART, KvDtype, field_meta, optional
from helexa.config.speculation import Speculation, parse_drafter


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


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
        "Memory of each device in MiB, for planning without a device; none = ask the device "
        "(a CUDA card). A CPU has no figure to ask: a CPU model is planned with this or with "
        "a kv_budget_mb (its own or [kv]'s).",
        RESTART)] = None
    drain_secs: Annotated[float, field_meta(
        "On SIGTERM, a draining unload or a profile switch that re-plans the pool, how long "
        "in-flight work may finish (a switch still busy then is refused model_busy).", RELOAD, ge=0)] = 30.0
    request_timeout_secs: Annotated[float, field_meta(
        "Deadline of a request that brings none of its own.", RELOAD, gt=0)] = 600.0
    heartbeat_secs: Annotated[float, field_meta(
        "Longest gap between Watch messages when nothing changes.", RELOAD, gt=0)] = 2.0
    max_tokenize_bytes: Annotated[int, field_meta(
        "Largest Tokenize call (/tokenize, /detokenize, count_tokens) in bytes of text, "
        "messages and tools; beyond it 400 naming this key.", RELOAD, ge=1)] = 4 * 1024 * 1024
    work_threads: Annotated[optional(int, ge=1), field_meta(
        "Threads that prepare prompts off the event loop (chat template, tokenizing, images, "
        "constraint grammar) for Generate, Complete and Tokenize; one principal runs on at "
        "most all but one of them. Unset = half the CPUs the neuron may run on (at least 2, "
        "at most 8), plus that one.", RESTART)] = None
    work_queue_depth: Annotated[int, field_meta(
        "Calls that may wait for a work thread; beyond it 503 overloaded.",
        RESTART, ge=0)] = 256
    work_per_principal: Annotated[optional(int, ge=1), field_meta(
        "Calls of one principal (callers without an API key are one) on the work threads or "
        "waiting for one; beyond it 429 rate_limit_exceeded while others still get in. "
        "Waiting calls are served round robin between principals. Unset = a quarter of "
        "work_threads + work_queue_depth (64 to 66 by default).", RELOAD)] = None


class AdmissionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_in_flight: Annotated[int, field_meta(
        "Requests holding a KV reservation at once, per model (a hybrid model: at most the "
        "linear-attention state slots its pool holds; model.limits_capped says so).",
        RELOAD, ge=1)] = 16
    max_queue_depth: Annotated[int, field_meta(
        "Requests waiting for admission, per model; beyond it 503 overloaded.", RELOAD, ge=0)] = 256
    max_per_principal: Annotated[int, field_meta(
        "Queued + in-flight requests of one principal; beyond it 429.", RELOAD, ge=1)] = 64
    anon_max_in_flight: Annotated[int, field_meta(
        "In-flight requests of anonymous callers together: callers without an API key where "
        "the router has keys (auth.keys_file). `helexa up` has no keys, so every caller is "
        "anonymous: it sets this to max_in_flight, the ordinary limits.", RELOAD, ge=0)] = 4
    max_in_flight_per_principal: Annotated[optional(int, ge=1), field_meta(
        "In-flight requests of one principal (an API key; anonymous callers together are "
        "one), per model; at it that principal's queued requests wait, never blocking "
        "others. none = no cap but max_in_flight: nothing is preempted, so one key's long "
        "requests may then hold every place for as long as they run.", RELOAD)] = None
    kv_max_wait_secs: Annotated[float, field_meta(
        "Longest a queued request waits (for an in-flight place or KV) before 503 overloaded.", RELOAD, ge=0)] = 30.0


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
        "Output budget reserved for a request without max_tokens (capped by the context left); "
        "with grow_output it grows by as much again while the pool has room.",
        RELOAD, ge=1)] = 1024
    grow_output: Annotated[bool, field_meta(
        "A request without max_tokens whose output reaches its reservation's end grows it by "
        "default_output_tokens (in whole blocks, up to the context and max_output_tokens) "
        "out of free blocks no queued request needs, and goes on; where none are, it ends "
        "with finish_reason length. false = it always ends there.", RELOAD)] = True
    activation_headroom_mb: Annotated[int, field_meta(
        "Memory kept free for activations when the pool is derived from device memory; for a "
        "model with a vision tower at least its encoder's over the largest image, and its "
        "embedding cache beside; on CUDA it holds a step's activations at max_batched_tokens, "
        "the decode graphs' pool, FlashInfer's workspaces and the rotary table too, and at "
        "tp > 1 the all-reduce workspace and a margin for NCCL (helexa plan shows each and "
        "whether they fit; the load measures a worst-case step on every card and trims a "
        "pool they would not leave room for).", RESTART, ge=0)] = 512
    prefix_cache: Annotated[bool, field_meta(
        "Share KV blocks of identical prompt prefixes between requests.", RESTART)] = True
    prefix_snapshots: Annotated[int, field_meta(
        "Hybrid models: slots for prefix snapshots of the linear-attention state (each the size"
        " of one request's state; fewer where the budget cannot hold them beside one full-"
        "context request; 0 = no prefix cache for hybrids).", RESTART, ge=0)] = 32
    prefix_checkpoint_tokens: Annotated[int, field_meta(
        "Hybrid models: a prefix snapshot every this many tokens inside a long prompt (rounded"
        " down to whole blocks), besides the prompt's end and the reply's.", RESTART,
        ge=1)] = 4096
    host_cache_mb: Annotated[int, field_meta(
        "Host memory in MiB (the model's, all its cards together) for the prefix cache's host "
        "tier: blocks and prefix snapshots evicted from the pool are kept there and copied "
        "back on a hit instead of recomputed; 0 = none. Off by default: on a CPU host the pool"
        " is host memory already, and on a GPU host the RAM is the operator's to share.",
        RESTART, ge=0)] = 0
    prefix_sharing: Annotated[Literal["principal", "global"], field_meta(
        "Whose cached prefixes a request may reuse: principal = only its own principal's "
        "(the router's API key; anonymous callers are one principal), global = anyone's. "
        "global reveals to every caller, through usage.cached_tokens and timing, whether "
        "another caller sent the same prompt prefix (docs/architecture.md).", RESTART)] = "principal"

    def __post_init__(self) -> None:
        if not _power_of_two(self.block_size):
            raise ValueError(f"block_size: expected a power of two, got {self.block_size}")


class EngineConfig(Speculation, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """[engine]: the scheduler's and the engine process's keys, and (from Speculation) every
    model's speculation."""

    max_slots: Annotated[int, field_meta(
        "Rows in the decode batch (running requests); more than a model was built for "
        "rebuilds it in place (switching).", RELOAD, ge=1)] = 8
    max_batched_tokens: Annotated[int, field_meta(
        "Token budget of one engine step (decode tokens + prefill chunks); more than a model "
        "was built for rebuilds it in place (switching).", RELOAD, ge=1)] = 2048
    prefill_chunk_tokens: Annotated[int, field_meta(
        "Largest prefill chunk of one request in one step.", RELOAD, ge=1)] = 512
    vision_step_ms: Annotated[float, field_meta(
        "Vision models: the vision-tower time one engine step aims at (the auto "
        "vision_step_budget: this over the tower's cost per patch × block, measured at load "
        "and in every step that runs it). A bystander's gap is a step's tower time plus its "
        "own decode step; 25 ms is about one decode step beside it, so an image at most "
        "doubles a gap: bench/vision_gaps.py's bystander decoded in 15-22 ms a step on a "
        "shared 2-core CPU (a GPU's decode step was not measured). At least "
        "one block of one image runs a step, however long it takes.", RELOAD, gt=0)] = 25.0
    vision_step_budget: Annotated[optional(int, ge=0), field_meta(
        "Vision models: the most vision-tower work one engine step runs, in patches × tower "
        "blocks (an image of P patches through a tower of D blocks is P × D). A larger "
        "image's tower runs a few blocks a step, so the other streams' tokens go on between "
        "them; a step runs at least one block of one image. Unset = auto: vision_step_ms "
        "over the tower's measured cost (logged as engine.vision_budget); 0 = each image's "
        "whole tower in one step.", RELOAD)] = None
    torch_threads: Annotated[optional(int, ge=1), field_meta(
        "torch threads of an engine process on CPU; none = torch's default.", RESTART)] = None
    attention_backend: Annotated[Literal["auto", "torch", "cpu", "cuda"], field_meta(
        "Attention backend: auto = cpu on CPU, cuda on a CUDA device when FlashInfer is "
        "installed (pip install -e '.[cuda]'), else torch; torch = plain SDPA reference.",
        RESTART)] = "auto"
    cuda_graphs: Annotated[bool, field_meta(
        "Capture decode steps as CUDA graphs (cuda backend, batch sizes up to max_slots).",
        RESTART)] = True
    # speculation, spec_k and the adaptive policy's thresholds: Speculation's keys

    def __post_init__(self) -> None:
        parse_drafter(self.speculation, "engine.speculation", per_model=False)
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
        "Overrides kv.default_output_tokens. With grow_output (the default) a request "
        "without max_tokens is not cut there: its budget grows by as much again while the "
        "pool has room, up to the context; set grow_output = false to end it there.",
        RELOAD)] = None
    grow_output: Annotated[bool | None, field_meta("Overrides kv.grow_output.", RELOAD)] = None
    speculation: Annotated[str | None, field_meta(
        "Overrides engine.speculation.", RELOAD)] = None
    spec_k: Annotated[optional(int, ge=0, le=16), field_meta("Overrides engine.spec_k.", RELOAD)] = None

    def __post_init__(self) -> None:
        if self.speculation is not None:
            parse_drafter(self.speculation, per_model=False)


class ModelEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, field_meta("Model id clients ask for, e.g. Qwen/Qwen3-8B.", RESTART)]
    path: Annotated[str | None, field_meta(
        "Checkpoint folder (config.json, *.safetensors, tokenizer), or a .gguf file (or a folder of "
        "one: docs/quantization.md; an mmproj*.gguf beside a Qwen3.5 GGUF is its vision tower). "
        "Relative paths are from the config file.",
        RESTART)] = None
    config: Annotated[str | None, field_meta(
        "config.json used for planning when the weights are not on this machine; default path/config.json.",
        RESTART)] = None
    tp: Annotated[int, field_meta("Tensor-parallel width (devices used).", RESTART, ge=1)] = 1
    devices: Annotated[list[str] | None, field_meta(
        "Devices of this model; none = the first tp devices of the neuron.", RESTART)] = None
    dtype: Annotated[Literal["auto", "fp32", "fp16", "bf16"], field_meta(
        "Weight dtype; auto = the checkpoint's torch_dtype, but a quantised or F32 GGUF on "
        "CPU runs fp32 or bf16, whichever decodes faster on this CPU (measured at load).",
        RESTART)] = "auto"
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
    profile: Annotated[str | None, field_meta(
        "Profile the model runs (a [profiles.NAME]). A reload changing it switches the model "
        "as `helexa ctl profile` does; one removing the profile a model was switched to at "
        "runtime switches it back to this one.", RELOAD)] = None
    context: Annotated[optional(int, ge=2), field_meta(
        "Advertised context (prompt + output tokens); the neuron refuses to start if the pool cannot hold it.",
        RESTART)] = None
    max_output_tokens: Annotated[optional(int, ge=1), field_meta(
        "Largest output a request may ask for; none = context - 1. More than context - 1 "
        "cannot be delivered: the neuron refuses to start, showing the context's arithmetic.",
        RESTART)] = None
    kv_budget_mb: Annotated[optional(int, ge=1), field_meta(
        "This model's KV pool in MiB per card; overrides kv.kv_budget_mb.", RESTART)] = None
    tool_parser: Annotated[Literal["auto", "hermes", "llama3_json", "qwen3_xml", "none"], field_meta(
        "How the model writes tool calls: hermes = <tool_call>{json}</tool_call> (Qwen2.5, Qwen3), llama3_json = a bare JSON object, qwen3_xml = <tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call> (Qwen3.5, Qwen3.6, Qwen3-Coder); auto = read from the chat template.",
        RESTART)] = "auto"
    reasoning_parser: Annotated[Literal["auto", "think", "none"], field_meta(
        "How the model writes its thought: think = <think>...</think>; auto = read from the chat template.",
        RESTART)] = "auto"
    thinking_budget_tokens: Annotated[int, field_meta(
        "Most tokens a thought may take at reasoning_effort high (and by default); medium is half, low an eighth; then the engine closes the thought.",
        RELOAD, ge=0)] = 4096
    # Speculation per model: over [engine], under the profile the model runs (docs/speculation.md).
    speculation: Annotated[str | None, field_meta(
        "This model's drafter, over engine.speculation: ngram, mtp, off, or draft:<model id> (a "
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
            method, _ = parse_drafter(self.speculation)
            if method == "draft" and self.tp > 1:
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
            draft = parse_drafter(m.speculation)[1] if m.speculation is not None else ""
            if draft and not any(d.id == draft and d.path for d in self.models):
                raise ValueError(f"models[{i}].speculation: expected draft:<model id> naming a "
                                 f"[[models]] entry with a `path`, got `{m.speculation}`")
            problem = device_problem(self.devices_of(m), m.tp)
            if problem:
                raise ValueError(f"models[{i}].devices: {problem}")
            if m.profile is not None and m.profile not in self.profiles:
                names = ", ".join(sorted(self.profiles)) or "none defined"
                raise ValueError(f"models[{i}].profile: expected one of the [profiles.*] ({names}),"
                                 f" got `{m.profile}`")

    def devices_of(self, entry: ModelEntry) -> list[str]:
        """The devices ``entry``'s ranks run on: its own, else the first tp of the neuron's."""
        return list(entry.devices or self.server.devices[: entry.tp])

    def devices_key(self, entry: ModelEntry) -> str:
        """The key that names ``entry``'s devices, for messages: its own, else the neuron's."""
        i = next((i for i, m in enumerate(self.models) if m.id == entry.id), None)
        if entry.devices is None:
            return "server.devices"
        return f"models[{i}].devices" if i is not None else f"models.{entry.id}.devices"

    def model(self, model_id: str) -> ModelEntry:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)

    def step_ceilings(self, profile: str = "") -> tuple[int, int]:
        """What a model running ``profile`` has its runner built for at load: the most
        decode rows (``max_slots``) of [engine] and every [profiles.*], so that a switch to
        any profile's batch width needs no re-plan (graphs captured for it); and the most
        tokens a step takes (``max_batched_tokens``) of [engine] and ``profile``'s, which
        its pool is measured beside (a switch asking for more rebuilds it in place:
        helexa/neuron/profile_switch.py widened)."""
        profiles = list(self.profiles.values())
        own = self.profiles.get(profile) if profile else None
        return (max([self.engine.max_slots] + [p.max_slots for p in profiles if p.max_slots]),
                max(self.engine.max_batched_tokens,
                    own.max_batched_tokens if own and own.max_batched_tokens else 0))



def canonical_device(device: str) -> str:
    """One name per card: a bare "cuda" is the process's current card, cuda:0 at start."""
    return "cuda:0" if device.strip() == "cuda" else device.strip()


def device_problem(devices: list[str], tp: int) -> str:
    """Why ``devices`` cannot hold ``tp`` ranks ("" when they can): on CUDA each rank needs
    a card of its own, named by its index (CPU ranks share the host)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return ""
    if len(devices) < tp:
        return (f"tp = {tp} needs {tp} devices, got {len(devices)} ({', '.join(devices)}): "
                "list a card per rank in server.devices or the model's devices")
    if tp > 1 and any(":" not in d for d in cuda):
        return (f"tp = {tp}: name each CUDA device by its index (cuda:0, cuda:1, ...), got "
                f"{', '.join(devices)}")
    named = [canonical_device(d) for d in devices[:tp]]
    if len(set(named)) < len(named):
        return (f"{', '.join(devices[:tp])} name one card twice: each tensor-parallel rank "
                "needs a card of its own")
    return ""
