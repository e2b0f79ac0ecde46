"""vLLM's speculative_config dict in LLM(...): every key mapped onto Config's fields, or refused with the reason."""
from __future__ import annotations

import json
import pathlib

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config, Mode
from saguaro_dist.serve.args import config_from_args
from saguaro_dist.speculative_config import config_fields

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [7, 8, 9], [5, 6, 5, 6, 5]]


# ---- the mapping ---------------------------------------------------------------------------------------
def test_a_draft_model_maps_to_draft_and_k():
    assert config_fields({"model": "org/draft", "num_speculative_tokens": 5}, {}) == {"draft": "org/draft", "k": 5}
    assert config_fields({"method": "draft_model", "model": pathlib.Path("d")}, {}) == {"draft": "d"}


def test_revision_is_the_drafts():
    assert config_fields({"model": "d", "revision": "v2"}, {}) == {"draft": "d", "draft_revision": "v2"}


def test_ngram_maps_to_mode_ngram_and_its_lookup_sizes():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert config_fields(spec, {}) == {"mode": Mode.NGRAM, "k": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize("key", ["prompt_lookup_min", "prompt_lookup_max"])
def test_one_ngram_lookup_size_stands_for_both_as_in_vllm(key):
    """{"prompt_lookup_min": 5} alone failed Config's min <= max against the default max of 3."""
    assert config_fields({"method": "ngram", key: 5}, {}) == {
        "mode": Mode.NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 5}
    Config(model="t", **config_fields({"method": "ngram", key: 5}, {}))


@pytest.mark.parametrize("name", ["ngram", "[ngram]"])
def test_a_model_named_ngram_without_a_method_is_ngram_as_in_vllm(name):
    assert config_fields({"model": name, "num_speculative_tokens": 3}, {}) == {"mode": Mode.NGRAM, "k": 3}


@pytest.mark.parametrize("mode", [None, "sd", "ssd", Mode.SD])
def test_a_draft_keeps_the_callers_draft_mode(mode):
    given = {} if mode is None else {"mode": mode}
    fields = config_fields({"model": "d"}, given)
    assert "mode" not in fields  # the caller's sd / ssd, else Config's default ssd
    assert Config(model="t", **{**given, **fields}).mode is (Mode.SSD if mode is None else Mode(mode))


def test_inert_keys_are_accepted_at_values_that_change_nothing():
    spec = {"model": "d", "draft_tensor_parallel_size": 1, "quantization": None, "max_model_len": None,
            "disable_logprobs": False, "rejection_sample_method": "standard", "enforce_eager": None}
    assert config_fields(spec, {}) == {"draft": "d"}


def test_none_sets_nothing_and_agreeing_values_are_no_conflict():
    assert config_fields(None, {"k": 3}) == {}
    given = {"draft": pathlib.Path("d"), "k": 3, "draft_revision": "v1", "mode": "sd", "prompt_lookup_max": 2}
    spec = {"model": "d", "num_speculative_tokens": 3, "revision": "v1", "prompt_lookup_max": 2}
    assert config_fields(spec, given) == {"draft": "d", "k": 3, "draft_revision": "v1", "prompt_lookup_max": 2,
                                             "prompt_lookup_min": 2}  # one size stands for both


def test_a_draft_given_as_draft_keyword_needs_no_model():
    assert config_fields({"num_speculative_tokens": 2}, {"draft": "d"}) == {"k": 2}


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp", "mlp_speculator", "deepseek_mtp"])
def test_head_methods_are_refused_with_the_reason(method):
    with pytest.raises(ValueError, match=f"method '{method}' is not supported: it drafts with heads trained"):
        config_fields({"method": method, "model": "head", "num_speculative_tokens": 3}, {})


@pytest.mark.parametrize("method, why", [("suffix", "suffix decoding"), ("ngram_gpu", "use method 'ngram'"),
                                         ("custom_class", "custom proposer"), ("magic", "supported: 'draft_model'")])
def test_other_methods_are_refused_with_the_reason(method, why):
    with pytest.raises(ValueError, match=f"method '{method}' is not supported: .*{why}"):
        config_fields({"method": method}, {})


@pytest.mark.parametrize("key, value, why", [
    ("draft_tensor_parallel_size", 2, "never sharded"),
    ("quantization", "fp8", "no quantized checkpoints"),
    ("max_model_len", 128, "every position the target does"),
    ("rejection_sample_method", "synthetic", "exact rejection sampling"),
    ("acceptance_method", "typical_acceptance_sampler", "exact rejection sampling"),
    ("synthetic_acceptance_length", 2.0, "change the output distribution"),
    ("disable_by_batch_size", 4, "fallback='auto'"),
    ("disable_logprobs", True, "logprobs are always the target's"),
    ("draft_tensor_parallel_size", True, "never sharded"),  # a bool is no size
])
def test_active_vllm_keys_are_refused_naming_key_and_reason(key, value, why):
    with pytest.raises(ValueError, match=f"speculative_config {key}={value!r} is not supported .*{why}"):
        config_fields({"model": "d", key: value}, {})


@pytest.mark.parametrize("key, hint", [("draft_revision", "vLLM's key is 'revision'"),
                                       ("tensor_parallel_size", "'draft_tensor_parallel_size'"),
                                       ("bogus", "supported: model, method")])
def test_unknown_keys_are_refused_naming_what_is_supported(key, hint):
    with pytest.raises(ValueError, match=f"key '{key}' is not supported.*{hint}"):
        config_fields({"model": "d", key: "x"}, {})


@pytest.mark.parametrize("spec, message", [
    ([("model", "d")], "must be a dict"),
    ({}, "needs 'model'"),
    ({"num_speculative_tokens": 4}, "needs 'model'"),
    ({"model": ""}, "draft's folder or Hugging Face id"),
    ({"model": 3}, "draft's folder or Hugging Face id"),
    ({"model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"model": "d", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_max": 2.0}, "prompt_lookup_max must be an integer >= 1"),
    ({"model": "d", "revision": ""}, "revision must be a branch"),
    ({"method": "ngram", "model": "d"}, "takes no model"),
    ({"method": "ngram", "revision": "v1"}, "method 'ngram' has none"),
])
def test_malformed_values_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        config_fields(spec, {})


@pytest.mark.parametrize("spec, given, message", [
    ({"model": "d1"}, {"draft": "d2"}, "model='d1' conflicts with draft='d2'"),
    ({"model": "d", "num_speculative_tokens": 4}, {"k": 2}, "num_speculative_tokens=4 conflicts with k=2"),
    ({"model": "d", "revision": "v1"}, {"draft_revision": "v2"}, "revision='v1' conflicts with draft_revision='v2'"),
    ({"method": "ngram", "prompt_lookup_min": 2}, {"prompt_lookup_min": 1}, "prompt_lookup_min=2 conflicts"),
    ({"method": "ngram"}, {"draft": "d"}, "takes no draft model, but draft='d' was given"),
    ({"model": "ngram"}, {"draft": "d"}, "takes no draft model"),
    ({"method": "ngram"}, {"mode": "ssd"}, "runs mode 'ngram', but mode='ssd'"),
    ({"model": "d"}, {"mode": "ar"}, "runs mode 'sd' or 'ssd', but mode='ar'"),
    ({"model": "d"}, {"mode": "ngram"}, "runs mode 'sd' or 'ssd', but mode='ngram'"),
    ({"model": "d"}, {"mode": "fast"}, "mode must be one of"),
])
def test_conflicts_with_the_callers_fields_are_refused(spec, given, message):
    with pytest.raises(ValueError, match=message):
        config_fields(spec, given)


def test_a_bad_dict_is_refused_before_any_model_loads():
    """The model does not exist: an error about it would mean the engine started building first."""
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        LLM(model="/no/such/target", speculative_config={"method": "eagle", "model": "/no/such/head"})
    with pytest.raises(ValueError, match="conflicts with k=2"):
        LLM(model="/no/such/target", k=2, speculative_config={"model": "/no/such/draft", "num_speculative_tokens": 3})


# ---- a real run ----------------------------------------------------------------------------------------
def greedy_tokens(target, **kwargs) -> tuple[Config, list[list[int]]]:
    with LLM(model=str(target), **kwargs) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        return llm.config, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_speculative_config_runs_as_draft_and_k_and_as_ar(tiny_llama_pair):
    target, draft = tiny_llama_pair
    spec_config, spec_tokens = greedy_tokens(target, mode="sd", speculative_config={
        "model": str(draft), "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    kw_config, kw_tokens = greedy_tokens(target, mode="sd", draft=str(draft), k=3)
    _, ar_tokens = greedy_tokens(target, mode="ar")
    assert spec_config == kw_config
    assert spec_tokens == kw_tokens == ar_tokens
    ngram_config, ngram_tokens = greedy_tokens(target, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert (ngram_config.mode, ngram_config.k, ngram_config.prompt_lookup_max) == (Mode.NGRAM, 2, 2)
    assert ngram_tokens == ar_tokens
    lone_config, lone_tokens = greedy_tokens(target)  # vLLM's LLM(model): no draft, no mode -> ar (it raised)
    assert (lone_config.mode, lone_tokens) == (Mode.AR, ar_tokens)
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(model=str(target), mode="ssd")  # an explicit draft mode still needs its draft


# ---- the same dict from `saguaro serve --speculative-config` and a `serve run` / KubeRay app's args ----------
def _serve_args(*flags: str, base: dict | None = None) -> dict:
    from saguaro_dist.cli import build_parser
    from saguaro_dist.cli.serve import engine_args
    return engine_args(build_parser().parse_args(["serve", *flags]), base)


def test_serve_flag_names_the_draft_and_k_as_draft_and_k_do():
    args = _serve_args("/t", "--speculative-config", '{"model": "/d", "num_speculative_tokens": 3}')
    assert (args["draft"], args["k"], args.get("mode", "ssd")) == ("/d", 3, "ssd")
    assert "speculative_config" not in args  # the app receives the fields alone
    assert config_from_args(args) == config_from_args(_serve_args("/t", "--draft", "/d", "--k", "3"))


def test_serve_flag_ngram_runs_mode_ngram_without_a_draft():
    args = _serve_args("/t", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 4}')
    assert config_from_args(args).mode is Mode.NGRAM and args["prompt_lookup_min"] == 4


@pytest.mark.parametrize("flags, message", [
    (["--speculative-config", '{"model": "/d", "num_speculative_tokens": 3}', "--k", "2"], "conflicts with k=2"),
    (["--speculative-config", "{model: d}"], "must be a JSON object"),
    (["--speculative-config", '{"method": "eagle", "model": "/e"}'], "method 'eagle' is not supported"),
    (["--speculative-config", '["/d"]'], "must be an object"),
])
def test_serve_flag_refuses_what_cannot_run_before_any_model_loads(flags, message):
    with pytest.raises(ValueError, match=message):
        _serve_args("/t", *flags)


def test_app_args_take_the_dict_or_its_json_and_compare_string_values_as_their_types():
    """`serve run app k=4` passes "4": the same k as num_speculative_tokens 4, not a conflict."""
    spec = {"model": "/d", "num_speculative_tokens": 4}
    for value in (spec, json.dumps(spec)):
        config = config_from_args({"model": "/t", "k": "4", "speculative_config": value})
        assert (config.draft, config.k, config.mode) == ("/d", 4, Mode.SSD)
    with pytest.raises(ValueError, match="conflicts with k=5"):
        config_from_args({"model": "/t", "k": "5", "speculative_config": spec})


def test_a_lone_model_in_app_args_decodes_autoregressively():
    """`serve run ...:build_app model=X` (or a hand-written serveConfigV2) refused it: Config's default mode ssd."""
    assert config_from_args({"model": "/t"}).mode is Mode.AR
    assert config_from_args({"model": "/t", "draft": "/d"}).mode is Mode.SSD
    with pytest.raises(ValueError, match="needs a draft"):
        config_from_args({"model": "/t", "mode": "sd"})


def test_one_lookup_size_stands_for_both_with_a_draft_model_too():
    assert config_fields({"model": "/d", "prompt_lookup_min": 5}, {})["prompt_lookup_max"] == 5


def test_vllms_max_num_seqs_is_max_batch_size(tiny_llama_pair):
    """vLLM's LLM(max_num_seqs=...) raised a bare TypeError; it is Config's max_batch_size (the CLI's alias too)."""
    config, tokens = greedy_tokens(tiny_llama_pair[0], mode="ar", max_num_seqs=2)
    assert config.max_batch_size == 2 and len(tokens) == len(PROMPTS)
    with pytest.raises(ValueError, match="max_num_seqs=2 and max_batch_size=3 are one setting"):
        LLM(model="/no/such/target", max_num_seqs=2, max_batch_size=3)
