"""Per-request sampling settings, validated at construction (the API edge)."""
from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from saguaro_dist.config import check_int, is_number
from saguaro_dist.plain_numbers import make_numbers_plain
from saguaro_dist.bad_word_ids import BadWordIds, bad_word_ids
from saguaro_dist.left_to_generate import check_left_to_generate

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 100.0  # as OpenAI's: a bias lies in [-100, 100]
MAX_TOP_K = 2 ** 31 - 1  # far past any vocabulary (a top_k past it keeps every token anyway)
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1  # int64
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS)
FLOAT32_MAX = 3.4028234663852886e38  # the engine holds the float settings in float32 tensors
# A seen token's logit is divided (> 0) or multiplied (<= 0) by the repetition penalty, then divided by a
# temperature down to GREEDY_BELOW. Within these bounds any logit under ~3e23 (a model's are far smaller)
# stays finite in float32; at 1e-40 a logit of 5 became inf (NaN probabilities: the last token id drawn),
# and 1e39, inf in float32, made a zero logit 0 * inf = NaN.
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 1e-10, 1e10

TokenBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, sorted by id


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's `structured_outputs`): exactly one of a JSON schema, any
    JSON object, a regular expression, a choice of strings, or a grammar (Lark, llguidance's dialect, or GBNF as vLLM takes it).
    The target's distribution is masked to the tokens the language allows at each position
    (engine/structured.py), on every path, so speculation stays exact."""
    json: str | None = None                  # a JSON schema (a dict is accepted and kept as its JSON text)
    json_object: bool = False                # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None    # one of these strings, exactly
    grammar: str | None = None               # a Lark (llguidance) or GBNF grammar
    # vLLM's options beside the constraint, accepted where they ask for what is served (check_structured_options)
    disable_any_whitespace: bool = False     # either way: JSON here has no free whitespace unless its x-guidance says
    disable_additional_properties: bool = False  # False only: a schema's own additionalProperties rule holds
    whitespace_pattern: str | None = None    # None only: a schema's x-guidance options set its whitespace
    structural_tag: str | None = None        # None only: there are no structural tags

    def __post_init__(self):
        if isinstance(self.json, Mapping):  # in the schema's order: llguidance writes properties in that order
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice) if not isinstance(self.choice, str) else self.choice)
        check_structured_options(self)
        given = [name for name in STRUCTURED_CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str) or not getattr(self, name)):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs choice must be a non-empty list of non-empty strings, got {self.choice!r}")


STRUCTURED_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


def check_structured_options(spec: StructuredOutputsParams) -> None:
    """vLLM's options: disable_any_whitespace either way (the server's JSON has no free whitespace, and in vLLM the
    request's flag only ever adds to the server's), the others at their inert values only."""
    if not isinstance(spec.disable_any_whitespace, bool):
        raise ValueError(f"structured_outputs disable_any_whitespace must be a boolean, got {spec.disable_any_whitespace!r}")
    for name, why in (("disable_additional_properties", "give the schema additionalProperties false"),
                      ("whitespace_pattern", "JSON whitespace is set by the schema's x-guidance options"),
                      ("structural_tag", "there are no structural tags")):
        if getattr(spec, name) is not None and getattr(spec, name) is not False:
            raise ValueError(f"structured_outputs {name} {getattr(spec, name)!r} is not supported ({why})")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0         # nucleus mass in (0, 1]
    top_k: int = 0             # 0 (or -1, as vLLM) disables top-k
    min_p: float = 0.0         # drop tokens below min_p x the likeliest's probability (vLLM's; 0 disables)
    max_tokens: int | None = 16  # None: to the end of the context (vLLM's), set per prompt by LLM (until_context_end)
    min_tokens: int = 0        # eos ids and stop_token_ids barred before this many tokens, ignore_eos or not (vLLM's)
    stop: tuple[str, ...] = ()  # stop strings; the output excludes them
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request like EOS (kept in token_ids, as vLLM)
    ignore_eos: bool = False
    seed: int | None = None    # makes a sampled request reproducible
    logprobs: int | None = None  # per generated token: its log-probability and the top-N's (0..20); None: none
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (costs a [P, V] LM head)
    # vLLM's penalties on the target's logits (spec/penalties.py), before temperature / top-k / top-p:
    presence_penalty: float = 0.0    # minus this for a token already in the output (-2..2; > 0 discourages)
    frequency_penalty: float = 0.0   # minus this times the token's count in the output (-2..2)
    repetition_penalty: float = 1.0  # > 1 shrinks the logits of tokens in the prompt or the output (HF's rule)
    # Before the penalties, as vLLM orders them (spec/logit_bias.py):
    logit_bias: TokenBias = ()  # {token id: bias in [-100, 100]} added to the logits (OpenAI's); kept as sorted pairs
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated (vLLM's); None: any
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar (vLLM's)
    # vLLM's output and prompt settings (they never change what is sampled):
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays at its end
    skip_special_tokens: bool = True          # special tokens are left out of the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (-1: the model's max length)
    # vLLM's: samples per prompt (LLM.generate / chat); sample i of a seeded request draws from seed + i. New fields
    # go last, so that positional arguments keep their places.
    n: int = 1
    detokenize: bool = True  # vLLM's: False leaves every output's text "" (token ids only); no stop strings then
    # vLLM's: the output may not complete these words (spec/bad_words.py); LLM tokenizes them with the model's
    # tokenizer into _bad_words_token_ids (vLLM's internal field), which the target masks with.
    bad_words: tuple[str, ...] | None = None
    _bad_words_token_ids: BadWordIds | None = None

    def __post_init__(self):
        """Every field checked (and normalized) here, at the API edge, in this order: a request with several bad
        fields is refused with the first one's message, whoever builds it."""
        make_numbers_plain(self)  # numpy / torch scalars as the int or float they hold
        object.__setattr__(self, "stop", checked_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", checked_stop_token_ids(self.stop_token_ids))
        check_lengths(self.max_tokens, self.min_tokens)
        object.__setattr__(self, "temperature", checked_temperature(self.temperature))
        if self.top_k == -1 and type(self.top_k) is int:  # vLLM's other spelling of "off"
            object.__setattr__(self, "top_k", 0)
        check_top(self.top_p, self.top_k)
        check_seed(self.seed)
        check_n(self.n, self.seed)
        check_min_p(self.min_p)
        check_logprobs(self.logprobs, self.prompt_logprobs)
        check_stop_strings(self.stop, self.detokenize)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        object.__setattr__(self, "logit_bias", token_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", allowed_tokens(self.allowed_token_ids))
        check_flags(self, ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"))
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        check_structured_outputs(self.structured_outputs)
        object.__setattr__(self, "bad_words", checked_bad_words(self.bad_words))
        object.__setattr__(self, "_bad_words_token_ids", checked_bad_word_ids(self._bad_words_token_ids))

    @property
    def biased(self) -> bool:
        """A logit bias or an allowed-token list changes the target's distribution."""
        return biased(self.logit_bias, self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        """Any penalty changes the target's distribution."""
        return penalized(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @property
    def banned_words(self) -> BadWordIds:
        """The bad words' token ids (empty: none, or not yet tokenized by LLM)."""
        return self._bad_words_token_ids or ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def checked_stop(stop) -> tuple:
    """stop as a tuple: one string is one stop string (not its characters)."""
    return (stop,) if isinstance(stop, str) else as_tuple(stop, "stop", "a string or a list of strings")


def checked_stop_token_ids(ids) -> tuple[int, ...]:
    """stop_token_ids as a tuple of token ids (a bool or a negative id indexes no token)."""
    ids = as_tuple(ids, "stop_token_ids", "a list of token ids")
    if any(type(t) is not int or t < 0 for t in ids):
        raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {list(ids)}")
    return ids


def check_lengths(max_tokens: int | None, min_tokens: int) -> None:
    """max_tokens >= 1 (None: to the context's end); min_tokens within 0..max_tokens."""
    if max_tokens is not None:
        check_int("max_tokens", max_tokens, 1)
    if type(min_tokens) is not int or not 0 <= min_tokens <= (max_tokens or min_tokens):
        raise ValueError(f"min_tokens must be an integer in 0..max_tokens ({max_tokens}), got {min_tokens!r}")


def check_seed(seed: int | None) -> None:
    """An int64: seeds travel to Ray's draft workers as protobuf int64, and a larger one failed the encoding
    there (codec.CodecError) inside the engine step, past the edge."""
    if seed is not None and (type(seed) is not int or not SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] (or None), got {seed!r}")


def check_logprobs(logprobs: int | None, prompt_logprobs: int | None) -> None:
    """Each None or an int in 0..MAX_LOGPROBS (OpenAI's top_logprobs bound)."""
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be an integer in 0..{MAX_LOGPROBS} (or None), got {value!r}")


def check_stop_strings(stop: tuple, detokenize: bool) -> None:
    """Non-empty strings, and text to match them in (vLLM's rule: no stop strings without detokenize)."""
    if any((not isinstance(s, str)) or not s for s in stop):
        raise ValueError("stop must be non-empty strings")
    if stop and detokenize is False:
        raise ValueError("stop strings need detokenize=True (they are matched in the output's text)")


def check_flags(params, names: tuple[str, ...]) -> None:
    """Each named field a real bool: the string "false" is truthy, and would have meant true."""
    for name in names:
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(params, name)!r}")


def check_truncate_prompt_tokens(keep: int | None) -> None:
    """None, an int >= 1, or -1 (the model's max length)."""
    if keep is not None and (type(keep) is not int or not (keep >= 1 or keep == -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for the model's max length, got {keep!r}")


def check_structured_outputs(structured) -> None:
    """None or a StructuredOutputsParams (which checked itself when built)."""
    if structured is not None and not isinstance(structured, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {structured!r}")


def checked_temperature(temperature: float) -> float:
    """The temperature, or 0 (greedy) under GREEDY_BELOW: logits / 1e-40 overflowed to inf (NaN
    probabilities, the last token id drawn). A NaN temperature passed `< 0` and sampled garbage. One that
    float32 cannot hold broke the engine step: 1e39 became inf, and a masked token's -inf / inf was NaN;
    the int 10**400 raised OverflowError, failing every request in flight."""
    if not is_number(temperature) or not 0 <= temperature <= FLOAT32_MAX:
        raise ValueError(f"temperature must be a number in [0, {FLOAT32_MAX:.4g}] (float32's largest), got {temperature!r}")
    return 0.0 if temperature < GREEDY_BELOW else temperature


def check_top(top_p: float, top_k: int) -> None:
    """top_p in (0, 1]; top_k bounded: the engine holds it in an int64 tensor, and a larger one failed the
    whole batch's step."""
    if not is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if type(top_k) is not int or not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be an integer in 0..{MAX_TOP_K} (0 or -1 disables it), got {top_k!r}")


def check_n(n: int, seed: int | None) -> None:
    """n an int >= 1 (sample i of a seeded request draws from seed + i wrapped into int64: llm_inputs.sample_seed,
    so any valid seed takes any n)."""
    if type(n) is not int or n < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")


def check_penalties(presence: float, frequency: float, repetition: float) -> None:
    """vLLM's ranges: presence and frequency in [-2, 2], repetition > 0 (1 disables it), and here also
    within [REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX], where the penalized logits stay finite."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not is_number(value) or not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
    if not is_number(repetition) or not REPETITION_PENALTY_MIN <= repetition <= REPETITION_PENALTY_MAX:
        raise ValueError(f"repetition_penalty must be a number in [{REPETITION_PENALTY_MIN:g}, "
                         f"{REPETITION_PENALTY_MAX:g}] (1 disables it), got {repetition!r}")


def truncate_prompt(tokens: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the model's max length; None: all)."""
    if keep is None:
        return tokens
    keep = max_model_len if keep == -1 else keep
    return tokens[-keep:]


def until_context_end(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """params with max_tokens None (vLLM's "to the end of the context") made the room the prompt leaves."""
    if params.max_tokens is not None:
        return params
    room, need = max_model_len - prompt_len, max(1, params.min_tokens)
    if room < need:
        raise ValueError(f"prompt ({prompt_len} tokens) leaves {max(room, 0)} of the model's max length "
                         f"{max_model_len} to generate; max_tokens=None with min_tokens={params.min_tokens} needs {need}")
    return replace(params, max_tokens=room)


def check_min_p(min_p: float) -> None:
    if not is_number(min_p) or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be a number in [0, 1] (0 disables it), got {min_p!r}")


def penalized(presence: float, frequency: float, repetition: float) -> bool:
    return presence != 0 or frequency != 0 or repetition != 1


def biased(logit_bias: TokenBias, allowed_token_ids: tuple[int, ...] | None) -> bool:
    return bool(logit_bias) or allowed_token_ids is not None


def as_tuple(values, name: str, what: str) -> tuple:
    """A list-like argument as a tuple (None: empty); anything else (a number, a bool, a string) is a ValueError."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be {what}, got {values!r}")
    return tuple(values)


def as_token_ids(prompt) -> list[int]:
    """One prompt's token ids: a list, array or tensor of integers. Floats, bools and digit strings are
    refused, not rounded or parsed (int() took 3.7 as 3 and "12" as 12)."""
    items = as_tuple(prompt, "prompt_token_ids", "a list of prompts, each a list of token ids (for one prompt: [[...]])")
    if any(isinstance(t, bool) for t in items):
        raise ValueError(f"prompt_token_ids must hold integer token ids, got {list(items)!r}")
    try:
        return [operator.index(t) for t in items]  # ints, numpy ints, integer tensors
    except TypeError:
        raise ValueError(f"prompt_token_ids must hold integer token ids, got {list(items)!r}") from None


def _token_id(t) -> bool:
    return type(t) is int and t >= 0


def token_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]] | None) -> TokenBias:
    """{token id: bias} (or pairs) -> (id, float bias) pairs sorted by id; ids ints >= 0, biases in [-100, 100]."""
    what = "a {token id: bias} mapping"
    items = bias.items() if isinstance(bias, Mapping) else as_tuple(bias, "logit_bias", what)
    pairs = [as_tuple(p, "logit_bias", what) for p in items]
    for pair in pairs:
        if len(pair) != 2 or not _token_id(pair[0]):
            raise ValueError(f"logit_bias maps token ids (ints >= 0) to biases, got {pair!r}")
        value = pair[1]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias of token {pair[0]} must be a number in [-100, 100], got {value!r}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))


def allowed_tokens(ids: Iterable[int] | None) -> tuple[int, ...] | None:
    """None (any token) or a non-empty tuple of distinct token ids, sorted."""
    if ids is None:
        return None
    what = "a non-empty list of token ids (ints >= 0)"
    ids = as_tuple(ids, "allowed_token_ids", what)
    if not ids or not all(_token_id(t) for t in ids):
        raise ValueError(f"allowed_token_ids must be {what}, got {ids!r}")
    return tuple(sorted(set(ids)))


def checked_bad_words(words) -> tuple[str, ...] | None:
    """None, or a tuple of non-empty strings (vLLM refuses an empty bad word)."""
    if words is None:
        return None
    words = as_tuple(words, "bad_words", "a list of strings")
    if not all(isinstance(w, str) and w for w in words):
        raise ValueError(f"bad_words must be non-empty strings, got {list(words)!r}")
    return words


def checked_bad_word_ids(ids) -> BadWordIds | None:
    """None, or a tuple of non-empty tuples of token ids."""
    if ids is None:
        return None
    what = "a list of token-id lists"
    ids = tuple(as_tuple(w, "_bad_words_token_ids", what) for w in as_tuple(ids, "_bad_words_token_ids", what))
    if not all(w and all(_token_id(t) for t in w) for w in ids):
        raise ValueError(f"_bad_words_token_ids must be {what} (non-empty, ids >= 0), got {ids!r}")
    return ids


def with_bad_word_ids(params, encode) -> SamplingParams:
    """params with its bad words tokenized (vLLM's update_from_tokenizer); encode(text) -> ids without
    special tokens, or None where the model has no tokenizer."""
    if not params.bad_words:
        return params if params._bad_words_token_ids is None else replace(params, _bad_words_token_ids=None)
    if encode is None:
        raise ValueError("bad_words needs the model's tokenizer (this model has none)")
    return replace(params, _bad_words_token_ids=bad_word_ids(params.bad_words, encode))


def check_against_model(params, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
    """What only the model can tell: the token ids a request names (logit_bias, allowed_token_ids) are in
    its vocabulary, and a token is left to generate while min_tokens holds the ends back."""
    named = (("logit_bias", [t for t, _ in params.logit_bias]), ("allowed_token_ids", params.allowed_token_ids),
             ("bad_words", [t for w in params.banned_words for t in w]))
    for name, ids in named:
        if ids and max(ids) >= vocab_size:
            raise ValueError(f"{name} names token {max(ids)}, outside the vocabulary (ids 0..{vocab_size - 1})")
    ends = set(params.stop_token_ids) | set(eos_token_ids)
    check_left_to_generate(params.allowed_token_ids, params.banned_words, params.min_tokens, ends, vocab_size)
