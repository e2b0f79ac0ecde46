from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DTYPE_UNSPECIFIED: _ClassVar[Tensor.DType]
        FLOAT32: _ClassVar[Tensor.DType]
        FLOAT16: _ClassVar[Tensor.DType]
        BFLOAT16: _ClassVar[Tensor.DType]
        FLOAT64: _ClassVar[Tensor.DType]
        INT64: _ClassVar[Tensor.DType]
        INT32: _ClassVar[Tensor.DType]
        INT16: _ClassVar[Tensor.DType]
        INT8: _ClassVar[Tensor.DType]
        UINT8: _ClassVar[Tensor.DType]
        BOOL: _ClassVar[Tensor.DType]
    DTYPE_UNSPECIFIED: Tensor.DType
    FLOAT32: Tensor.DType
    FLOAT16: Tensor.DType
    BFLOAT16: Tensor.DType
    FLOAT64: Tensor.DType
    INT64: Tensor.DType
    INT32: Tensor.DType
    INT16: Tensor.DType
    INT8: Tensor.DType
    UINT8: Tensor.DType
    BOOL: Tensor.DType
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Tensor.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Tensor.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DraftSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "grammar", "min_p", "bad_words", "min_tokens", "end_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    min_p: float
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenList]
    min_tokens: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ..., min_p: _Optional[float] = ..., bad_words: _Optional[_Iterable[_Union[TokenList, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("vocab_size", "row_offsets", "token_ids", "probs")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    row_offsets: Tensor
    token_ids: Tensor
    probs: Tensor
    def __init__(self, vocab_size: _Optional[int] = ..., row_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("tokens", "dense", "sparse")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    tokens: Tensor
    dense: Tensor
    sparse: SparseProbs
    def __init__(self, tokens: _Optional[_Union[Tensor, _Mapping]] = ..., dense: _Optional[_Union[Tensor, _Mapping]] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "sampling", "shard", "num_shards", "prompt_len", "generation", "cache_salt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: DraftSampling
    shard: int
    num_shards: int
    prompt_len: int
    generation: int
    cache_salt: str
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[DraftSampling, _Mapping]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., prompt_len: _Optional[int] = ..., generation: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class JitDraftRequest(_message.Message):
    __slots__ = ("seq_id", "round", "accepted", "bonus_token", "skip_tree", "generation")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SKIP_TREE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    accepted: int
    bonus_token: int
    skip_tree: bool
    generation: int
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus_token: _Optional[int] = ..., skip_tree: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("seq_id", "round", "accepted", "bonus_token", "next_tokens", "cache_hit", "skip_tree", "tree_wait_s", "target_proposed", "generation")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    SKIP_TREE_FIELD_NUMBER: _ClassVar[int]
    TREE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    accepted: int
    bonus_token: int
    next_tokens: TokenList
    cache_hit: bool
    skip_tree: bool
    tree_wait_s: float
    target_proposed: bool
    generation: int
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus_token: _Optional[int] = ..., next_tokens: _Optional[_Union[TokenList, _Mapping]] = ..., cache_hit: _Optional[bool] = ..., skip_tree: _Optional[bool] = ..., tree_wait_s: _Optional[float] = ..., target_proposed: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class SpeculationTree(_message.Message):
    __slots__ = ("seq_id", "round", "accepted", "bonus_tokens", "proposals", "build_s", "generation")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus_tokens: _containers.RepeatedScalarFieldContainer[int]
    proposals: Proposal
    build_s: float
    generation: int
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., bonus_tokens: _Optional[_Iterable[int]] = ..., proposals: _Optional[_Union[Proposal, _Mapping]] = ..., build_s: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class TreePlan(_message.Message):
    __slots__ = ("seq_id", "round", "accepted", "bonus_tokens", "guess_ids", "guess_probs", "generation")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUESS_IDS_FIELD_NUMBER: _ClassVar[int]
    GUESS_PROBS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus_tokens: _containers.RepeatedScalarFieldContainer[int]
    guess_ids: Tensor
    guess_probs: Tensor
    generation: int
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., bonus_tokens: _Optional[_Iterable[int]] = ..., guess_ids: _Optional[_Union[Tensor, _Mapping]] = ..., guess_probs: _Optional[_Union[Tensor, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("seq_id", "generation")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    generation: int
    def __init__(self, seq_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class PrefillBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PrefillRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PrefillRequest, _Mapping]]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JitDraftBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[JitDraftRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[JitDraftRequest, _Mapping]]] = ...) -> None: ...

class ProposalBatch(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class OutcomeBatch(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[Outcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ...) -> None: ...

class OutcomeRounds(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[OutcomeBatch]
    def __init__(self, rounds: _Optional[_Iterable[_Union[OutcomeBatch, _Mapping]]] = ...) -> None: ...

class SpeculationTreeBatch(_message.Message):
    __slots__ = ("trees",)
    TREES_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[SpeculationTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[SpeculationTree, _Mapping]]] = ...) -> None: ...

class TreePlanBatch(_message.Message):
    __slots__ = ("plans",)
    PLANS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[TreePlan]
    def __init__(self, plans: _Optional[_Iterable[_Union[TreePlan, _Mapping]]] = ...) -> None: ...

class ReleaseBatch(_message.Message):
    __slots__ = ("releases",)
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    releases: _containers.RepeatedCompositeFieldContainer[Release]
    def __init__(self, releases: _Optional[_Iterable[_Union[Release, _Mapping]]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCache(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JitDraftCall(_message.Message):
    __slots__ = ("call_id", "batch")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    batch: JitDraftBatch
    def __init__(self, call_id: _Optional[int] = ..., batch: _Optional[_Union[JitDraftBatch, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class JitDraftResult(_message.Message):
    __slots__ = ("call_id", "proposals", "error", "parts_after")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    proposals: ProposalBatch
    error: CallError
    parts_after: int
    def __init__(self, call_id: _Optional[int] = ..., proposals: _Optional[_Union[ProposalBatch, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., parts_after: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("outcomes", "jit_draft", "releases", "reset_prefix_cache", "catch_up")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    JIT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    outcomes: OutcomeBatch
    jit_draft: JitDraftCall
    releases: ReleaseBatch
    reset_prefix_cache: ResetPrefixCache
    catch_up: OutcomeRounds
    def __init__(self, outcomes: _Optional[_Union[OutcomeBatch, _Mapping]] = ..., jit_draft: _Optional[_Union[JitDraftCall, _Mapping]] = ..., releases: _Optional[_Union[ReleaseBatch, _Mapping]] = ..., reset_prefix_cache: _Optional[_Union[ResetPrefixCache, _Mapping]] = ..., catch_up: _Optional[_Union[OutcomeRounds, _Mapping]] = ...) -> None: ...

class SpeculateReply(_message.Message):
    __slots__ = ("trees", "jit_draft", "plans", "graph_captures")
    TREES_FIELD_NUMBER: _ClassVar[int]
    JIT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURES_FIELD_NUMBER: _ClassVar[int]
    trees: SpeculationTreeBatch
    jit_draft: JitDraftResult
    plans: TreePlanBatch
    graph_captures: int
    def __init__(self, trees: _Optional[_Union[SpeculationTreeBatch, _Mapping]] = ..., jit_draft: _Optional[_Union[JitDraftResult, _Mapping]] = ..., plans: _Optional[_Union[TreePlanBatch, _Mapping]] = ..., graph_captures: _Optional[int] = ...) -> None: ...
