from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_SWITCHING: _ClassVar[ModelState]
    MODEL_STATE_DRAINING: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_SWITCHING: ModelState
MODEL_STATE_DRAINING: ModelState
MODEL_STATE_FAILED: ModelState

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "top_logprobs", "logprobs", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    top_logprobs: int
    logprobs: bool
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name", "reasoning_content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    reasoning_content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools_json", "template_kwargs_json", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    template_kwargs_json: str
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark", "tool_choice", "calls_or_answer")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CALLS_OR_ANSWER_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    tool_choice: ToolChoice
    calls_or_answer: CallsOrAnswer
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., calls_or_answer: _Optional[_Union[CallsOrAnswer, _Mapping]] = ...) -> None: ...

class CallsOrAnswer(_message.Message):
    __slots__ = ("parallel", "answer_schema")
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    parallel: bool
    answer_schema: str
    def __init__(self, parallel: _Optional[bool] = ..., answer_schema: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("function", "parallel")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    function: str
    parallel: bool
    def __init__(self, function: _Optional[str] = ..., parallel: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("req_id", "model", "principal", "chat", "text", "token_ids", "max_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "deadline_unix_ms", "return_prompt_token_ids", "constraint", "reasoning_effort", "thinking_budget_tokens", "fit_max_tokens", "return_prompt_text")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    THINKING_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    model: str
    principal: str
    chat: Chat
    text: str
    token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    deadline_unix_ms: int
    return_prompt_token_ids: bool
    constraint: Constraint
    reasoning_effort: str
    thinking_budget_tokens: int
    fit_max_tokens: bool
    return_prompt_text: bool
    def __init__(self, req_id: _Optional[str] = ..., model: _Optional[str] = ..., principal: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., deadline_unix_ms: _Optional[int] = ..., return_prompt_token_ids: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., reasoning_effort: _Optional[str] = ..., thinking_budget_tokens: _Optional[int] = ..., fit_max_tokens: _Optional[bool] = ..., return_prompt_text: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top", "token_bytes", "text_offset")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token_bytes: bytes
    text_offset: int
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token_bytes: _Optional[bytes] = ..., text_offset: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "prefill_ms", "decode_ms", "queue_ms", "reasoning_tokens", "draft_tokens", "accepted_draft_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_ms: float
    decode_ms: float
    queue_ms: float
    reasoning_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., reasoning_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "prompt_token_ids", "stop_reason", "thought_open", "prompt_tokens", "fitted_max_tokens", "cached_tokens", "prefill_started", "waiting_for_row", "prompt_logprobs", "prompt_text")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    THOUGHT_OPEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FITTED_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STARTED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_ROW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_reason: str
    thought_open: bool
    prompt_tokens: int
    fitted_max_tokens: int
    cached_tokens: int
    prefill_started: bool
    waiting_for_row: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_text: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., stop_reason: _Optional[str] = ..., thought_open: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., fitted_max_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_started: _Optional[bool] = ..., waiting_for_row: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("heartbeat_ms",)
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ms: int
    def __init__(self, heartbeat_ms: _Optional[int] = ...) -> None: ...

class KvLedger(_message.Message):
    __slots__ = ("total_bytes", "free_bytes", "cached_bytes", "reserved_bytes", "used_bytes", "block_size", "bytes_per_token", "fixed_bytes_per_request", "state_total_bytes", "state_free_bytes", "host_total_bytes", "host_cached_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIXED_BYTES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STATE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    free_bytes: int
    cached_bytes: int
    reserved_bytes: int
    used_bytes: int
    block_size: int
    bytes_per_token: int
    fixed_bytes_per_request: int
    state_total_bytes: int
    state_free_bytes: int
    host_total_bytes: int
    host_cached_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., cached_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., fixed_bytes_per_request: _Optional[int] = ..., state_total_bytes: _Optional[int] = ..., state_free_bytes: _Optional[int] = ..., host_total_bytes: _Optional[int] = ..., host_cached_bytes: _Optional[int] = ...) -> None: ...

class AdmissionLimits(_message.Message):
    __slots__ = ("max_in_flight", "max_queue_depth", "max_per_principal", "anon_max_in_flight", "max_slots", "max_batched_tokens", "kv_max_wait_secs", "default_output_tokens", "max_in_flight_per_principal")
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PER_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ANON_MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_MAX_WAIT_SECS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_PER_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    max_in_flight: int
    max_queue_depth: int
    max_per_principal: int
    anon_max_in_flight: int
    max_slots: int
    max_batched_tokens: int
    kv_max_wait_secs: float
    default_output_tokens: int
    max_in_flight_per_principal: int
    def __init__(self, max_in_flight: _Optional[int] = ..., max_queue_depth: _Optional[int] = ..., max_per_principal: _Optional[int] = ..., anon_max_in_flight: _Optional[int] = ..., max_slots: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., kv_max_wait_secs: _Optional[float] = ..., default_output_tokens: _Optional[int] = ..., max_in_flight_per_principal: _Optional[int] = ...) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ("context", "input", "output", "fixed_bytes_per_request", "prefix_cache", "prefix_sharing")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FIXED_BYTES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHARING_FIELD_NUMBER: _ClassVar[int]
    context: int
    input: int
    output: int
    fixed_bytes_per_request: int
    prefix_cache: bool
    prefix_sharing: str
    def __init__(self, context: _Optional[int] = ..., input: _Optional[int] = ..., output: _Optional[int] = ..., fixed_bytes_per_request: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., prefix_sharing: _Optional[str] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("model", "state", "error", "kv", "in_flight", "queued", "running", "admission", "limits", "decode_tokens_per_sec", "prefill_tokens_per_sec", "profile", "kv_dtype", "tp", "last_used_unix_ms", "attention_backend", "tool_parser", "reasoning_parser", "drafter", "spec_drafted_tokens", "spec_accepted_tokens", "vision", "activations", "paused", "ready_unix_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    READY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    state: ModelState
    error: str
    kv: KvLedger
    in_flight: int
    queued: int
    running: int
    admission: AdmissionLimits
    limits: ModelLimits
    decode_tokens_per_sec: float
    prefill_tokens_per_sec: float
    profile: str
    kv_dtype: str
    tp: int
    last_used_unix_ms: int
    attention_backend: str
    tool_parser: str
    reasoning_parser: str
    drafter: str
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    vision: VisionInput
    activations: str
    paused: int
    ready_unix_ms: int
    def __init__(self, model: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., error: _Optional[str] = ..., kv: _Optional[_Union[KvLedger, _Mapping]] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., admission: _Optional[_Union[AdmissionLimits, _Mapping]] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., decode_tokens_per_sec: _Optional[float] = ..., prefill_tokens_per_sec: _Optional[float] = ..., profile: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., tp: _Optional[int] = ..., last_used_unix_ms: _Optional[int] = ..., attention_backend: _Optional[str] = ..., tool_parser: _Optional[str] = ..., reasoning_parser: _Optional[str] = ..., drafter: _Optional[str] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., vision: _Optional[_Union[VisionInput, _Mapping]] = ..., activations: _Optional[str] = ..., paused: _Optional[int] = ..., ready_unix_ms: _Optional[int] = ...) -> None: ...

class VisionInput(_message.Message):
    __slots__ = ("pixels_per_token", "min_pixels", "max_pixels")
    PIXELS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    pixels_per_token: int
    min_pixels: int
    max_pixels: int
    def __init__(self, pixels_per_token: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class NeuronStatus(_message.Message):
    __slots__ = ("neuron", "models", "draining", "seq", "unix_ms", "catalogue")
    NEURON_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CATALOGUE_FIELD_NUMBER: _ClassVar[int]
    neuron: str
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    draining: bool
    seq: int
    unix_ms: int
    catalogue: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, neuron: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., draining: _Optional[bool] = ..., seq: _Optional[int] = ..., unix_ms: _Optional[int] = ..., catalogue: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CatalogueEntry(_message.Message):
    __slots__ = ("model", "tp", "priority", "profile", "resident")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp: int
    priority: int
    profile: str
    resident: bool
    def __init__(self, model: _Optional[str] = ..., tp: _Optional[int] = ..., priority: _Optional[int] = ..., profile: _Optional[str] = ..., resident: _Optional[bool] = ...) -> None: ...

class ModelsResponse(_message.Message):
    __slots__ = ("catalogue", "models")
    CATALOGUE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    catalogue: _containers.RepeatedCompositeFieldContainer[CatalogueEntry]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, catalogue: _Optional[_Iterable[_Union[CatalogueEntry, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model", "principal", "retry_failed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    RETRY_FAILED_FIELD_NUMBER: _ClassVar[int]
    model: str
    principal: str
    retry_failed: bool
    def __init__(self, model: _Optional[str] = ..., principal: _Optional[str] = ..., retry_failed: _Optional[bool] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("status", "evicted")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    status: ModelStatus
    evicted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[ModelStatus, _Mapping]] = ..., evicted: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("model", "drain", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    drain: bool
    force: bool
    def __init__(self, model: _Optional[str] = ..., drain: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class SetProfileRequest(_message.Message):
    __slots__ = ("model", "profile")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    model: str
    profile: str
    def __init__(self, model: _Optional[str] = ..., profile: _Optional[str] = ...) -> None: ...

class SetProfileResponse(_message.Message):
    __slots__ = ("status", "changed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    status: ModelStatus
    changed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[ModelStatus, _Mapping]] = ..., changed: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "neuron", "version")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NEURON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    status: str
    neuron: str
    version: str
    def __init__(self, status: _Optional[str] = ..., neuron: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "chat", "text", "token_ids", "add_special_tokens", "add_generation_prompt", "reasoning_effort", "principal")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    chat: Chat
    text: str
    token_ids: TokenIds
    add_special_tokens: bool
    add_generation_prompt: bool
    reasoning_effort: str
    principal: str
    def __init__(self, model: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., reasoning_effort: _Optional[str] = ..., principal: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...
