"""vLLM's `speculative_config` dict (LLM(speculative_config=...), `vllm serve --speculative-config`) mapped onto
Config's fields, so a vLLM user's configuration runs here unchanged or is refused with the reason.

Pure: it reads the dict and the fields the caller gave otherwise, and builds nothing (a bad dict leaks nothing).
A key left out takes the caller's field or Config's default, not vLLM's: num_speculative_tokens k (4), and for
ngram prompt_lookup_max 3 / min 1 where neither is given (vLLM: 5 / 5; one given stands for both, as vLLM's); only speed differs, never outputs.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

from saguaro_dist.config import DRAFT_MODES, Mode, parse_enum

__all__ = ["config_fields", "as_dict", "SUPPORTED_KEYS"]

NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM: such a model and no method means method "ngram"
SUPPORTED_METHODS = ("draft_model", "ngram")
SUPPORTED_KEYS = ("model", "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "revision",
                  "draft_tensor_parallel_size", "draft_sample_method")
# vLLM's draft_sample_method as proposal_top_k: 'greedy' (vLLM's default) drafts the argmax and rejection-samples
# against a one-hot q, as top-1 proposals do; 'probabilistic' drafts from the whole distribution. Both are exact.
DRAFT_SAMPLE_TOP_K = {"greedy": 1, "probabilistic": 0}
# vLLM's methods that need what saguaro_dist does not run: heads or layers trained on the target's hidden states
_HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "extract_hidden_states", "dflash", "dflare",
                 "dspark", "deepseek_mtp")
_OTHER_METHODS = {
    "suffix": "suffix decoding (its trees of past responses) is not implemented: method 'ngram' is the nearest",
    "ngram_gpu": "use method 'ngram' (prompt lookup runs on whichever device the engine does)",
    "custom_class": "no custom proposer classes are loaded",
}
# vLLM keys that change nothing here at the values listed (vLLM's defaults, or what this engine does anyway);
# any other value is refused with the reason
_INERT = {
    "draft_tensor_parallel_size": ((None, 1), "the draft runs whole on one device in each draft worker (it is "
                                   "never sharded); scale drafting with num_draft_workers on Ray"),
    "quantization": ((None,), "the draft loads in `dtype` (no quantized checkpoints)"),
    "max_model_len": ((None,), "the draft covers every position the target does (give LLM(max_model_len=...))"),
    "code_revision": ((None,), "no remote code is loaded (give the draft's weights revision as 'revision')"),
    "enforce_eager": ((None,), "give LLM(enforce_eager=...): it applies to both models"),
    "rejection_sample_method": (("standard",), "only exact rejection sampling runs (the target's distribution is kept)"),
    "acceptance_method": (("rejection_sampler",), "only exact rejection sampling runs (the target's distribution is kept)"),
    "disable_logprobs": ((False,), "logprobs are always the target's, as requested in SamplingParams"),
    "disable_by_batch_size": ((None,), "fallback='auto' and tree_policy='auto' adapt speculation to the batch size"),
    "disable_padded_drafter_batch": ((False,), "it applies to EAGLE only"),
    "parallel_drafting": ((False,), "the draft drafts its K tokens one after another"),
    "use_heterogeneous_vocab": ((False,), "the draft must share the target's vocabulary"),
    "use_local_argmax_reduction": ((False,), "the draft is never tensor-parallel"),
    "enable_adaptive_verification": ((False,), "it applies to method 'dspark' only"),
    "num_speculative_tokens_per_batch_size": ((None,), "k is one number (SSD's trees adapt to the batch instead)"),
    "synthetic_acceptance_rates": ((None,), "synthetic acceptance would change the output distribution"),
    "synthetic_acceptance_length": ((None,), "synthetic acceptance would change the output distribution"),
    "speculative_token_tree": ((None,), "SSD builds its own trees (fan_out, fan_out_kind)"),
    "moe_backend": ((None,), "the draft uses the engine's kernels"),
    "attention_backend": ((None,), "the draft uses the engine's kernels"),
    "kv_cache_dtype": ((None,), "the draft's KV cache is in `dtype`"),
    "draft_load_config": ((None,), "the draft loads as the target does"),
}
_HINTS = {"draft_revision": "vLLM's key is 'revision' (the draft's; the target's is LLM(revision=...))",
          "tensor_parallel_size": "vLLM's key is 'draft_tensor_parallel_size' (the target's is "
                                  "LLM(tensor_parallel_size=...))",
          "draft_model": "the draft's key is 'model'"}


def as_dict(spec) -> dict | None:
    """speculative_config as a dict: given as one, or as its JSON text (`--speculative-config`, a manifest's
    arg); None stays None."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(f"speculative_config must be a JSON object (vLLM's), e.g. '{{\"model\": \"DRAFT\", "
                             f"\"num_speculative_tokens\": 4}}', got {spec!r}") from None
    if spec is not None and not isinstance(spec, Mapping):
        raise ValueError(f"speculative_config must be an object (a dict of vLLM's keys), got {spec!r}")
    return None if spec is None else dict(spec)


def config_fields(speculative_config: Mapping | None, given: Mapping) -> dict:
    """Config fields (draft, mode, k, prompt_lookup_*, draft_revision) that `speculative_config` sets.

    given: the Config fields the caller set otherwise (LLM's keywords, a CLI's explicit flags: not defaults);
    a speculative_config value that contradicts one is refused, as is any key or method not run here.
    None: no fields. The result merges over `given` without changing any field `given` sets."""
    if speculative_config is None:
        return {}
    if not isinstance(speculative_config, Mapping):
        raise ValueError(f"speculative_config must be a dict (vLLM's keys), got {type(speculative_config).__name__}")
    _refuse_keys(speculative_config)
    fields = {}
    if _method(speculative_config) == "ngram":
        _ngram_fields(speculative_config, given, fields)
    else:
        _draft_fields(speculative_config, given, fields)
    _draft_sampling(speculative_config, given, fields)
    _count("num_speculative_tokens", "k", speculative_config, given, fields)
    _count("prompt_lookup_max", "prompt_lookup_max", speculative_config, given, fields)
    _count("prompt_lookup_min", "prompt_lookup_min", speculative_config, given, fields)
    _one_lookup_size_for_both(given, fields)
    return fields


def _one_lookup_size_for_both(given: Mapping, fields: dict) -> None:
    """vLLM's ngram: prompt_lookup_min or _max given alone stands for both (min 5 alone would fail min <= max
    against our default max of 3); with a draft model the sizes set ssd's n-gram backup, by the same rule."""
    for one, other in (("prompt_lookup_min", "prompt_lookup_max"), ("prompt_lookup_max", "prompt_lookup_min")):
        if one in fields and other not in fields and given.get(other) is None:
            fields[other] = fields[one]


def _refuse_keys(spec: Mapping) -> None:
    """Every key must be one mapped here, or one of vLLM's at a value that changes nothing here."""
    for key, value in spec.items():
        if key in SUPPORTED_KEYS and key not in _INERT:
            continue
        if key in _INERT:
            accepted, why = _INERT[key]
            if any(value is a or (value == a and type(value) is type(a)) for a in accepted):
                continue
            shown = " or ".join(repr(a) for a in accepted)
            raise ValueError(f"speculative_config {key}={value!r} is not supported ({shown} only): {why}")
        hint = f" ({_HINTS[key]})" if key in _HINTS else ""
        raise ValueError(f"speculative_config key {key!r} is not supported{hint}; supported: "
                         f"{', '.join(SUPPORTED_KEYS)} (method {' or '.join(map(repr, SUPPORTED_METHODS))})")


def _method(spec: Mapping) -> str:
    """'draft_model' or 'ngram', as vLLM infers it: no method means ngram for a model named so, else a draft."""
    method = spec.get("method")
    if method is None:
        return "ngram" if spec.get("model") in NGRAM_MODEL_NAMES else "draft_model"
    if method in SUPPORTED_METHODS:
        return method
    if method in _HEAD_METHODS:
        why = ("it drafts with heads trained on the target's hidden states; saguaro_dist drafts with a separate "
               "small model (method 'draft_model': mode sd / ssd) or prompt lookup (method 'ngram')")
    else:
        why = _OTHER_METHODS.get(method, f"supported: {' or '.join(map(repr, SUPPORTED_METHODS))}")
    raise ValueError(f"speculative_config method {method!r} is not supported: {why}")


def _ngram_fields(spec: Mapping, given: Mapping, fields: dict) -> None:
    """Prompt lookup: mode ngram, no draft model to name, pin or give."""
    model = spec.get("model")
    if model is not None and model not in NGRAM_MODEL_NAMES:
        raise ValueError(f"speculative_config method 'ngram' proposes from each sequence's own tokens and takes no "
                         f"model: drop 'model' ({model!r}), or use method 'draft_model'")
    if given.get("draft") is not None:
        raise ValueError(f"speculative_config method 'ngram' takes no draft model, but draft={given['draft']!r} was "
                         f"given: drop one")
    if spec.get("revision") is not None:
        raise ValueError("speculative_config 'revision' pins the draft model's weights: method 'ngram' has none")
    mode = _given_mode(given)
    if mode not in (None, Mode.NGRAM):
        raise ValueError(f"speculative_config method 'ngram' runs mode 'ngram', but mode={mode.value!r} was given")
    fields["mode"] = Mode.NGRAM


def _draft_fields(spec: Mapping, given: Mapping, fields: dict) -> None:
    """A draft model: mode sd or ssd (the caller's mode, else Config's default ssd), the draft and its revision."""
    model = spec.get("model")
    if model is not None:
        if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).strip():
            raise ValueError(f"speculative_config model must be the draft's folder or Hugging Face id, got {model!r}")
        _take("model", os.fspath(model), "draft", given, fields, same=lambda a, b: os.fspath(a) == b)
    elif given.get("draft") is None:
        raise ValueError("speculative_config needs 'model' (the draft's folder or Hugging Face id) or method 'ngram'")
    revision = spec.get("revision")
    if revision is not None:
        if not isinstance(revision, str) or not revision.strip():
            raise ValueError(f"speculative_config revision must be a branch, tag or commit, got {revision!r}")
        _take("revision", revision, "draft_revision", given, fields)
    mode = _given_mode(given)
    if mode is not None and mode not in DRAFT_MODES:
        raise ValueError(f"speculative_config with a draft model runs mode 'sd' or 'ssd', but mode={mode.value!r} "
                         f"was given")


def _draft_sampling(spec: Mapping, given: Mapping, fields: dict) -> None:
    """draft_sample_method -> proposal_top_k for a draft model; method 'ngram' has no draft distribution to
    sample (vLLM ignores it there too)."""
    method = spec.get("draft_sample_method")
    if method is None:
        return
    if method not in DRAFT_SAMPLE_TOP_K:
        raise ValueError(f"speculative_config draft_sample_method must be 'greedy' or 'probabilistic' (vLLM's), "
                         f"got {method!r}")
    if fields.get("mode") is Mode.NGRAM:
        return
    top_k, other = DRAFT_SAMPLE_TOP_K[method], given.get("proposal_top_k")
    if other is not None and str(other) != str(top_k):
        raise ValueError(f"speculative_config draft_sample_method={method!r} drafts with proposal_top_k={top_k}, "
                         f"but proposal_top_k={other!r} was given: give one")
    fields["proposal_top_k"] = top_k


def _count(key: str, field: str, spec: Mapping, given: Mapping, fields: dict) -> None:
    """num_speculative_tokens -> k, prompt_lookup_* -> themselves: integers >= 1, absent: left to Config."""
    value = spec.get(key)
    if value is None:
        return
    if type(value) is not int or value < 1:
        raise ValueError(f"speculative_config {key} must be an integer >= 1, got {value!r}")
    _take(key, value, field, given, fields)


def _take(key: str, value, field: str, given: Mapping, fields: dict, same=lambda a, b: a == b) -> None:
    """fields[field] = value, unless the caller gave that field another value: one setting, said twice."""
    if given.get(field) is not None and not same(given[field], value):
        raise ValueError(f"speculative_config {key}={value!r} conflicts with {field}={given[field]!r}: give it once")
    fields[field] = value


def _given_mode(given: Mapping) -> Mode | None:
    mode = given.get("mode")
    return None if mode is None else parse_enum(Mode, mode, "mode")


VLLM_NAMES = {"max_num_seqs": "max_batch_size"}  # vLLM's LLM(...) keywords for Config fields named otherwise


def with_config_names(kwargs: Mapping) -> dict:
    """LLM's keywords with vLLM's names (max_num_seqs) under Config's; both names at different values is refused."""
    fields = dict(kwargs)
    for vllm_name, field in VLLM_NAMES.items():
        if vllm_name in fields:
            value = fields.pop(vllm_name)
            if field in fields and fields[field] != value:
                raise ValueError(f"{vllm_name}={value!r} and {field}={fields[field]!r} are one setting (vLLM's name "
                                 f"and ours): give one")
            fields[field] = value
    return fields
