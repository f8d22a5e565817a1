"""Typed messages between the neuron daemon and a model's engine process.

The daemon and the engine exchange token ids, never text: one `ToEngine`
message per engine step inbound (new requests, aborts, control) and one
`FromEngine` per step outbound (each request's new tokens, admissions,
refusals, completions, and the model's status). Encoded with msgspec
(msgpack) over a pipe.
"""

from __future__ import annotations

import enum

import msgspec

from helexa.config.neuron import AdmissionConfig, EngineConfig, KvConfig
from helexa.config.speculation import Speculation

# The config's defaults, which the engine's own limits take (never restated here).
_ADMISSION, _KV, _ENGINE = AdmissionConfig(), KvConfig(), EngineConfig()


class FinishReason(enum.IntEnum):
    """Why a request ended (values match the proto's FinishReason)."""

    STOP = 1  # eos, a stop token or a stop string
    LENGTH = 2  # max_tokens or the context limit
    ABORT = 3  # caller gone, deadline, drain, explicit abort
    ERROR = 4  # the engine failed while running this request


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick the next token; defaults are greedy-free OpenAI defaults."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # alternatives per token (0..20)
    # the prompt's tokens' logprobs (prompt_logprobs.py), with this many alternatives each;
    # None: off. Such a request takes no prefix-cache hit (it needs every position's logits).
    prompt_logprobs: int | None = None


class Thinking(msgspec.Struct, frozen=True, kw_only=True):
    """How a thinking model's thought is bounded. The thought starts with `open_ids` (or
    at once when `starts_open`: the prompt opened it) and ends with `close_ids`; once
    `budget_tokens` tokens were spent inside it, the engine writes `close_ids` itself."""

    budget_tokens: int
    open_ids: list[int] = []
    close_ids: list[int] = []
    starts_open: bool = False


class ImageInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt, resized for the tower (helexa/neuron/vision/processor.py): its
    tokens are prompt_token_ids[offset : offset + rows × cols] (the image pad id)."""

    offset: int
    rows: int  # image tokens down and across (the patch grid / the spatial merge)
    cols: int
    grid_h: int  # patches down and across
    grid_w: int
    pixels: bytes  # uint8 RGB [grid_h × patch, grid_w × patch, 3]
    content_hash: bytes  # equal for equal pixels: the prefix cache keys its tokens by it

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.cols


class NewRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request handed to the engine (already tokenised and context-checked)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    # None = min(default_output_tokens, context - prompt), growable (growth.py)
    max_tokens: int | None = None
    # fit_max_tokens: the caller's max_tokens, a ceiling `max_tokens` was fitted under to the
    # context; a queued request is fitted again where a profile switch changes the context
    max_tokens_ceiling: int | None = None
    principal: str = ""  # "" = anonymous
    # eos ids are added by the daemon unless ignore_eos; the caller's are left out where
    # the reply's tool calls are tagged (the daemon stops at them outside calls)
    stop_token_ids: list[int] = []
    deadline_unix: float = 0.0  # absolute deadline (time.time()); 0 = none
    arrival_unix: float = 0.0
    # Constrained decoding: an llguidance grammar (helexa.grammar made it) the output follows.
    grammar: str | None = None
    thinking: Thinking | None = None  # the model thinks: budget and markers (None = it does not)
    images: list[ImageInput] = []  # a vision-language prompt's images, in prompt order


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Abort a request wherever it is; the engine answers with ABORT finished."""

    req_id: str
    # client_gone | deadline | stop_string | stop_token | drain | unload
    reason: str = "client_gone"


class Limits(Speculation, frozen=True, kw_only=True):
    """Every runtime (reload-safe) knob, as the engine runs under it: the speculation that
    applies to the model (its base: helexa/config/speculation.py) and the reload keys of
    [admission], [kv] and [engine], by their config names and with their config defaults
    (tests/test_config.py holds the two lists equal). The daemon sends the whole set each
    time (helexa/neuron/engine/spec.py limits_from_config); the engine replaces its own."""

    max_in_flight: int = _ADMISSION.max_in_flight
    max_queue_depth: int = _ADMISSION.max_queue_depth
    max_per_principal: int = _ADMISSION.max_per_principal
    anon_max_in_flight: int = _ADMISSION.anon_max_in_flight
    max_in_flight_per_principal: int | None = _ADMISSION.max_in_flight_per_principal
    kv_max_wait_secs: float = _ADMISSION.kv_max_wait_secs
    max_slots: int = _ENGINE.max_slots
    max_batched_tokens: int = _ENGINE.max_batched_tokens
    prefill_chunk_tokens: int = _ENGINE.prefill_chunk_tokens
    vision_step_ms: float = _ENGINE.vision_step_ms
    vision_step_budget: int | None = _ENGINE.vision_step_budget
    default_output_tokens: int = _KV.default_output_tokens
    grow_output: bool = _KV.grow_output


class ResetKv(msgspec.Struct, frozen=True, kw_only=True):
    """Re-plan the KV pool without reloading weights (a profile's kv_dtype switch, a
    hybrid's state slots, a batch wider than the runner was built for).

    Only while nothing is in flight: the daemon stops admitting and waits for
    in-flight work to finish first. Queued requests stay queued. (Added by the
    engine helper.)"""

    num_blocks: int
    kv_dtype: str
    bytes_per_token: int
    context: int
    max_output_tokens: int | None = None
    # a hybrid model's linear-attention state slots, one a request in flight, carved anew
    # beside the blocks (a profile's max_in_flight); 0 = as they are
    num_state_slots: int = 0
    # the decode rows and step tokens the runner is built for (a profile wider than the
    # load's: graphs captured again, the pool measured beside such a step); 0 = as they are
    max_slots: int = 0
    max_batched_tokens: int = 0


class ToEngine(msgspec.Struct, kw_only=True):
    """One inbound message: everything the daemon has for the next step."""

    new: list[NewRequest] = []
    aborts: list[Abort] = []
    limits: Limits | None = None  # the whole set in force from now on
    stop_admitting: bool = False  # drain / switching: admit none, finish in flight
    # drain: refuse what is queued (shutting_down) at once
    refuse_queued: bool = False
    # drain: refuse newcomers too while admission stays stopped (a level, as stop_admitting:
    # each message carries the current one); a switch's stop without it holds them queued
    # until admission resumes
    refuse_new: bool = False
    shutdown: bool = False  # exit after aborting everything
    reset_kv: ResetKv | None = None  # answered by FromEngine.kv_reset (added by the engine helper)
    # Flow control (client.py): req_id -> True where its caller stopped taking its tokens
    # (the engine leaves it out of steps, its reservation held), False once it takes them
    # again; the latest word on a request wins.
    paused: dict[str, bool] = {}


class TopToken(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[TopToken]


class RequestUpdate(msgspec.Struct, kw_only=True):
    """What happened to one request in one step."""

    req_id: str
    new_token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): the prompt tokens this step's prefill
    # chunk scored, in order, from the second prompt token on (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None
    admitted: bool = False  # became in flight in this step (reservation held)
    prompt_tokens: int = 0  # set when admitted
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (set when admitted)
    output_budget: int = 0  # the most new tokens it may produce, as admitted (set then)
    # Got a batch row in this step (its prefill begins; or, resumed from a pause, its
    # decode goes on): until then an admitted request waits for one (max_slots).
    started: bool = False
    # Lost its batch row after it made tokens and waits for one again (resumed behind a full
    # batch, or its row went back to a request admitted before it: intake.reclaim); its next
    # tokens come once it has one, bounded by its deadline. Unset again by a step that
    # gives it the row.
    waiting_for_row: bool = False
    finished: FinishReason | None = None
    # A refusal ends the request before it produced anything: code is the
    # OpenAI-style code (overloaded, rate_limit_exceeded, shutting_down, ...).
    refused_code: str | None = None
    refused_message: str = ""
    retry_after_ms: int = 0
    error: str = ""  # set with finished=ERROR
    reasoning_tokens: int = 0  # output tokens spent thinking (set when finished)
    # Speculation, the request's totals so far (set in a step that verified drafts, and when
    # finished): drafted tokens verified, and of those accepted.
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0


class KvLedger(msgspec.Struct, frozen=True, kw_only=True):
    """The pool in bytes per card: total = free + reserved + used (free includes cached)."""

    total_bytes: int
    free_bytes: int  # free + cached: what a new reservation may take
    cached_bytes: int
    reserved_bytes: int
    used_bytes: int
    block_size: int
    bytes_per_token: int
    # Hybrid models: linear-attention state per request, and the slots' share of the totals.
    fixed_bytes_per_request: int = 0
    state_total_bytes: int = 0
    state_free_bytes: int = 0
    # Hybrid models' prefix snapshots (snapshot_pool.py), already in the figures above.
    snapshot_total_bytes: int = 0
    snapshot_cached_bytes: int = 0
    # The prefix cache's host tier (host_tier.py, kv.host_cache_mb): host memory per card,
    # apart from the figures above (never room a reservation may take).
    host_total_bytes: int = 0
    host_cached_bytes: int = 0


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The model's live figures, sent with every outbound message that changed them."""

    kv: KvLedger
    in_flight: int
    queued: int
    running: int
    paused: int = 0  # in flight, left out of steps: their callers are not reading (client.py)
    decode_tokens_per_sec: float = 0.0
    prefill_tokens_per_sec: float = 0.0
    admitting: bool = True
    # Prefix cache, cumulative since start (added by the engine helper):
    # prompt tokens of admitted requests, and how many of them were reused.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # ... of which restored from the host tier, and the tier's copies out and in (blocks).
    prefix_host_hit_tokens: int = 0
    host_offloaded_blocks: int = 0
    host_restored_blocks: int = 0
    # The runner's attention backend and what it chose (helexa/kernels/backends/), "" for fakes.
    attention_backend: str = ""
    # Speculative decoding, cumulative since start: the drafter ("off" = none), tokens
    # drafted and verified, and how many of those the target accepted.
    drafter: str = "off"
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Growable reservations (growth.py), cumulative since start: growths, and growths refused
    # because the pool had no room, because requests queued for KV needed what it had, or
    # because admitted requests waited for a batch row, or because the engine was not
    # admitting (a drain or a profile switch waiting for in-flight work to end).
    kv_growths: int = 0
    kv_growths_refused_no_room: int = 0
    kv_growths_refused_queued: int = 0
    kv_growths_refused_waiting: int = 0
    kv_growths_refused_not_admitting: int = 0


class FromEngine(msgspec.Struct, kw_only=True):
    """One outbound message per step."""

    updates: list[RequestUpdate] = []
    status: EngineStatus | None = None
    step_ms: float = 0.0
    fatal: str = ""  # the engine is going down; every open request is failed
    # Start-up only (added by the engine helper): loading progress text, and
    # ready=True once, when the model is loaded and the engine takes requests.
    progress: str = ""
    ready: bool = False
    # Answer to ToEngine.reset_kv: "ok", or why the pool was not re-planned.
    kv_reset: str = ""


# A kv_reset answer that starts so: requests were in flight; the caller may wait for them
# and ask again (client.EngineBusy).
RESET_BUSY = "busy: "
