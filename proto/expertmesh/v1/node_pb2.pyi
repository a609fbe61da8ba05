from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelKey(_message.Message):
    __slots__ = ("repo_id", "commit")
    REPO_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    repo_id: str
    commit: str
    def __init__(self, repo_id: _Optional[str] = ..., commit: _Optional[str] = ...) -> None: ...

class ExpertKey(_message.Message):
    __slots__ = ("model", "layer", "expert")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    model: ModelKey
    layer: int
    expert: int
    def __init__(self, model: _Optional[_Union[ModelKey, _Mapping]] = ..., layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("node_id", "role", "models", "ram_budget_bytes", "disk_budget_bytes", "disk_used_bytes", "expertmesh_version", "mlx_version", "protocol_version", "live_peers", "expert_uses", "expert_bytes", "generated_tokens", "generation_seconds", "ram_used_bytes", "compute", "generation_slots", "hub_requests", "hub_quota", "shared_rows", "prefixes_held")
    class ExpertUsesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ExpertBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HubRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HubQuotaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERTMESH_VERSION_FIELD_NUMBER: _ClassVar[int]
    MLX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_USES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HUB_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HUB_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SHARED_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_HELD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    models: _containers.RepeatedCompositeFieldContainer[ModelKey]
    ram_budget_bytes: int
    disk_budget_bytes: int
    disk_used_bytes: int
    expertmesh_version: str
    mlx_version: str
    protocol_version: int
    live_peers: int
    expert_uses: _containers.ScalarMap[str, int]
    expert_bytes: _containers.ScalarMap[str, int]
    generated_tokens: int
    generation_seconds: float
    ram_used_bytes: int
    compute: bool
    generation_slots: int
    hub_requests: _containers.ScalarMap[str, int]
    hub_quota: _containers.ScalarMap[str, int]
    shared_rows: bool
    prefixes_held: _containers.RepeatedCompositeFieldContainer[PrefixHeld]
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelKey, _Mapping]]] = ..., ram_budget_bytes: _Optional[int] = ..., disk_budget_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., expertmesh_version: _Optional[str] = ..., mlx_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., live_peers: _Optional[int] = ..., expert_uses: _Optional[_Mapping[str, int]] = ..., expert_bytes: _Optional[_Mapping[str, int]] = ..., generated_tokens: _Optional[int] = ..., generation_seconds: _Optional[float] = ..., ram_used_bytes: _Optional[int] = ..., compute: _Optional[bool] = ..., generation_slots: _Optional[int] = ..., hub_requests: _Optional[_Mapping[str, int]] = ..., hub_quota: _Optional[_Mapping[str, int]] = ..., shared_rows: _Optional[bool] = ..., prefixes_held: _Optional[_Iterable[_Union[PrefixHeld, _Mapping]]] = ...) -> None: ...

class PrefixHeld(_message.Message):
    __slots__ = ("key", "tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tokens: int
    def __init__(self, key: _Optional[bytes] = ..., tokens: _Optional[int] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelKey
    def __init__(self, model: _Optional[_Union[ModelKey, _Mapping]] = ...) -> None: ...

class LayerBitmap(_message.Message):
    __slots__ = ("layer", "num_experts", "bits")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    num_experts: int
    bits: bytes
    def __init__(self, layer: _Optional[int] = ..., num_experts: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("model", "layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: ModelKey
    layers: _containers.RepeatedCompositeFieldContainer[LayerBitmap]
    def __init__(self, model: _Optional[_Union[ModelKey, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerBitmap, _Mapping]]] = ...) -> None: ...

class FetchExpertRequest(_message.Message):
    __slots__ = ("key", "fetch_on_miss", "keep_only", "progress")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FETCH_ON_MISS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    key: ExpertKey
    fetch_on_miss: bool
    keep_only: bool
    progress: bool
    def __init__(self, key: _Optional[_Union[ExpertKey, _Mapping]] = ..., fetch_on_miss: _Optional[bool] = ..., keep_only: _Optional[bool] = ..., progress: _Optional[bool] = ...) -> None: ...

class ExpertChunk(_message.Message):
    __slots__ = ("size", "sha256", "data", "progress")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    size: int
    sha256: str
    data: bytes
    progress: FetchProgress
    def __init__(self, size: _Optional[int] = ..., sha256: _Optional[str] = ..., data: _Optional[bytes] = ..., progress: _Optional[_Union[FetchProgress, _Mapping]] = ...) -> None: ...

class FetchProgress(_message.Message):
    __slots__ = ("fetching", "received_bytes")
    FETCHING_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    fetching: bool
    received_bytes: int
    def __init__(self, fetching: _Optional[bool] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "chat", "max_tokens", "temperature", "top_p", "seed", "messages", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "logit_bias", "logprobs", "top_logprobs", "count_only", "tools", "tool_choice", "tool_choice_name", "response_format", "prefix_space", "prompt_experts")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COUNT_ONLY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_NAME_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    model: ModelKey
    prompt: str
    chat: bool
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    top_k: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    count_only: bool
    tools: str
    tool_choice: str
    tool_choice_name: str
    response_format: str
    prefix_space: str
    prompt_experts: str
    def __init__(self, model: _Optional[_Union[ModelKey, _Mapping]] = ..., prompt: _Optional[str] = ..., chat: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., count_only: _Optional[bool] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_choice_name: _Optional[str] = ..., response_format: _Optional[str] = ..., prefix_space: _Optional[str] = ..., prompt_experts: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolsParsedCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolsUnparsedCall(_message.Message):
    __slots__ = ("text", "reason")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    text: str
    reason: str
    def __init__(self, text: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("id", "text", "seconds", "expert_uses", "hub_bytes", "prompt_tokens", "logprob", "token_bytes", "top_logprobs", "tool_calls", "unparsed_tool_calls", "cached_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_USES_FIELD_NUMBER: _ClassVar[int]
    HUB_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    UNPARSED_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    seconds: float
    expert_uses: int
    hub_bytes: int
    prompt_tokens: int
    logprob: float
    token_bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[ApiTopLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolsParsedCall]
    unparsed_tool_calls: _containers.RepeatedCompositeFieldContainer[ToolsUnparsedCall]
    cached_tokens: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., seconds: _Optional[float] = ..., expert_uses: _Optional[int] = ..., hub_bytes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[ApiTopLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolsParsedCall, _Mapping]]] = ..., unparsed_tool_calls: _Optional[_Iterable[_Union[ToolsUnparsedCall, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ApiTopLogprob(_message.Message):
    __slots__ = ("id", "logprob", "token_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    token_bytes: bytes
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class GenerationDone(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "time_to_first_token_s", "seconds", "stop_reason", "trailing_text", "expert_uses", "expert_bytes", "forward_passes", "drafted_tokens", "accepted_tokens", "tool_calls", "unparsed_tool_calls", "cached_tokens", "prefixes_held", "prompt_expert_uses_substituted")
    class ExpertUsesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ExpertBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TRAILING_TEXT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_USES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    UNPARSED_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_HELD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EXPERT_USES_SUBSTITUTED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float
    seconds: float
    stop_reason: str
    trailing_text: str
    expert_uses: _containers.ScalarMap[str, int]
    expert_bytes: _containers.ScalarMap[str, int]
    forward_passes: int
    drafted_tokens: int
    accepted_tokens: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolsParsedCall]
    unparsed_tool_calls: _containers.RepeatedCompositeFieldContainer[ToolsUnparsedCall]
    cached_tokens: int
    prefixes_held: _containers.RepeatedCompositeFieldContainer[PrefixHeld]
    prompt_expert_uses_substituted: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., seconds: _Optional[float] = ..., stop_reason: _Optional[str] = ..., trailing_text: _Optional[str] = ..., expert_uses: _Optional[_Mapping[str, int]] = ..., expert_bytes: _Optional[_Mapping[str, int]] = ..., forward_passes: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolsParsedCall, _Mapping]]] = ..., unparsed_tool_calls: _Optional[_Iterable[_Union[ToolsUnparsedCall, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., prefixes_held: _Optional[_Iterable[_Union[PrefixHeld, _Mapping]]] = ..., prompt_expert_uses_substituted: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: TokenEvent
    done: GenerationDone
    def __init__(self, token: _Optional[_Union[TokenEvent, _Mapping]] = ..., done: _Optional[_Union[GenerationDone, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExpertRows(_message.Message):
    __slots__ = ("expert", "rows", "row_index")
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_INDEX_FIELD_NUMBER: _ClassVar[int]
    expert: int
    rows: Tensor
    row_index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, expert: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., row_index: _Optional[_Iterable[int]] = ...) -> None: ...

class ComputeExpertsRequest(_message.Message):
    __slots__ = ("model", "layer", "experts", "fetch_on_miss", "rows")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    FETCH_ON_MISS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    model: ModelKey
    layer: int
    experts: _containers.RepeatedCompositeFieldContainer[ExpertRows]
    fetch_on_miss: bool
    rows: Tensor
    def __init__(self, model: _Optional[_Union[ModelKey, _Mapping]] = ..., layer: _Optional[int] = ..., experts: _Optional[_Iterable[_Union[ExpertRows, _Mapping]]] = ..., fetch_on_miss: _Optional[bool] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ComputeExpertsResponse(_message.Message):
    __slots__ = ("experts", "missing", "compute_seconds", "queued", "mlx_wait_seconds")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MLX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedCompositeFieldContainer[ExpertRows]
    missing: _containers.RepeatedScalarFieldContainer[int]
    compute_seconds: float
    queued: int
    mlx_wait_seconds: float
    def __init__(self, experts: _Optional[_Iterable[_Union[ExpertRows, _Mapping]]] = ..., missing: _Optional[_Iterable[int]] = ..., compute_seconds: _Optional[float] = ..., queued: _Optional[int] = ..., mlx_wait_seconds: _Optional[float] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("nonce", "dialed")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DIALED_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    dialed: str
    def __init__(self, nonce: _Optional[bytes] = ..., dialed: _Optional[str] = ...) -> None: ...

class ProveResponse(_message.Message):
    __slots__ = ("node_id", "role", "disk_budget_bytes", "compute", "protocol_version", "mac")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    disk_budget_bytes: int
    compute: bool
    protocol_version: int
    mac: bytes
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., disk_budget_bytes: _Optional[int] = ..., compute: _Optional[bool] = ..., protocol_version: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...
