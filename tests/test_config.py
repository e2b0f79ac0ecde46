"""Config / SamplingParams / serve-args validation at the edges: clear ValueErrors, nothing started."""
from __future__ import annotations

from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saguaro_dist import Config, FallbackPolicy, Mode, SamplingParams
from saguaro_dist import DraftExecutor, FanOut
from saguaro_dist.serve.args import config_from_args


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.5"), "temperature"), (dict(temperature=True), "temperature"), (dict(top_p="1"), "top_p"),
    (dict(top_k=2 ** 70), "top_k"), (dict(top_k=True), "top_k"), (dict(max_tokens=True), "max_tokens"),
    (dict(seed="abc"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=["2"]), "stop_token_ids"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.0), "min_tokens"), (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(frequency_penalty="0.5"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={3: 100.5}), "logit_bias"), (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"3": 1.0}), "logit_bias"),
    (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "logit_bias"), (dict(logit_bias={3: True}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=7), "allowed_token_ids"), (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"), (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"), (dict(min_p="0.1"), "min_p"),
])
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k


def test_logit_bias_and_allowed_tokens_are_kept_sorted_and_hashable():
    params = SamplingParams(logit_bias={9: -100, 2: 0.5}, allowed_token_ids=[7, 2, 7])
    assert params.logit_bias == ((2, 0.5), (9, -100.0)) and params.allowed_token_ids == (2, 7)
    assert params.biased and not SamplingParams().biased and hash(params) == hash(SamplingParams(
        logit_bias=[(2, 0.5), (9, -100.0)], allowed_token_ids=(2, 7)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), "k must be"), (dict(fan_out=3, k=4), "fan_out budget"), (dict(fan_out=[1, 2], k=4), "k\\+1"),
    (dict(saguaro_c=1.5), "saguaro_c"), (dict(proposal_top_k=-1), "proposal_top_k"), (dict(jit_cohorts=3), "jit_cohorts"), (dict(jit_cohorts=True), "jit_cohorts"), (dict(tree_policy="sometimes"), "tree_policy"), (dict(proposal_top_k=2.0), "proposal_top_k"), (dict(mode="beam"), "mode must be one of"), (dict(draft=None), "needs a draft"),
    (dict(mode="ngram"), "takes no draft model"), (dict(mode="ar"), "mode .ar. decodes with the target alone"), (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "1 <= min <= max"), (dict(prompt_lookup_max=2.5), "prompt_lookup"),
    (dict(fallback="slow"), "fallback must be one of"), (dict(dtype="int8"), "dtype"),
    (dict(draft_executor="fork"), "draft_executor must be one of"), (dict(mode="sd", draft_executor="split"), "splits SSD's draft"), (dict(cluster="local", draft_executor="thread"), "one-host only"), (dict(fan_out_kind="zipf"), "fan_out_kind must be one of"),
    (dict(device="tpu"), "device must be"), (dict(device="cuda:x"), "device must be"), (dict(device=0), "device must be"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be"), (dict(max_model_len=0), "max_model_len must be an integer >= 1"),
    (dict(max_model_len=2.5), "max_model_len must be"), (dict(max_batch_size=2.5), "max_batch_size must be"),
    (dict(enforce_eager="yes"), "enforce_eager must be true or false"), (dict(draft_device="gpu"), "draft_device must be"),
    (dict(k=True), "k must be"), (dict(saguaro_c="0.5"), "saguaro_c"), (dict(saguaro_c=None), "saguaro_c"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size"), (dict(num_draft_workers=None), "num_draft_workers"),
    (dict(target_threads=0), "target_threads"), (dict(draft_threads="1"), "draft_threads"),
    (dict(cluster=3), "cluster must be"), (dict(cluster=""), "cluster must be"), (dict(model=""), "model must be"),
    (dict(draft=["d"]), "draft must be"), (dict(target_resources=[1]), "target_resources"),
    (dict(draft_resources={"draft": -1}), "draft_resources"), (dict(fan_out=[True] * 5), "k\\+1"),
])
def test_config_rejects_bad_values(kwargs, message):
    settings = dict(model="m", draft="d") | kwargs
    with pytest.raises(ValueError, match=message):
        Config(**settings)


ODD = st.booleans() | st.none() | st.text(max_size=3) | st.integers(-3, 5) | st.floats(allow_nan=True) | st.just([1, 2])


@settings(max_examples=1000, deadline=None)
@given(kwargs=st.fixed_dictionaries({}, optional={f.name: ODD | st.just({"a": 1}) for f in fields(Config) if f.name != "model"}))
def test_any_config_arguments_are_refused_with_a_value_error_or_taken(kwargs):
    """Property: whatever the arguments, a ValueError naming the field or a Config; never a TypeError from
    a comparison deep inside (tensor_parallel_size="2" and saguaro_c=None raised those)."""
    try:
        Config(model="m", **({"draft": "d"} | kwargs))
    except ValueError:
        pass


def test_a_path_is_a_folder_too(tmp_path):
    assert Config(model=tmp_path, draft=tmp_path / "d").model == str(tmp_path)


def test_config_parses_enums_and_lists():
    c = Config(model="m", draft="d", mode="sd", fallback="fast", fan_out=[1, 2, 3, 4, 5])
    assert c.mode is Mode.SD and c.fallback is FallbackPolicy.FAST and c.fan_out == (1, 2, 3, 4, 5)
    assert c.fan_out_budget == 15
    assert Config(model="m", mode="ar").draft is None
    c = Config(model="m", draft="d", draft_executor="thread", fan_out_kind="outcome")
    assert c.draft_executor is DraftExecutor.THREAD and c.fan_out_kind is FanOut.OUTCOME


def test_hit_glue_from_the_api_and_the_cli():
    import argparse

    from saguaro_dist import HitGlue
    from saguaro_dist.cli.serve import add_engine_args, engine_args
    assert Config(model="m", draft="d").hit_glue is HitGlue.AUTO
    assert Config(model="m", draft="d", hit_glue="skip").hit_glue is HitGlue.SKIP
    with pytest.raises(ValueError, match="hit_glue"):
        Config(model="m", draft="d", hit_glue="sometimes")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(engine_args(parser.parse_args(["--hit-glue", "always"]))).hit_glue is HitGlue.ALWAYS


def test_auto_draft_executor_is_split_for_ssd_and_a_thread_for_sd():
    from saguaro_dist.engine.build import draft_executor
    assert draft_executor(Config(model="m", draft="d", mode="ssd")) is DraftExecutor.SPLIT
    assert draft_executor(Config(model="m", draft="d", mode="sd")) is DraftExecutor.THREAD


@pytest.mark.parametrize("device, draft_device, mode, advised", [
    ("cuda", None, "ssd", True), ("cuda:1", "cuda:1", "ssd", True), ("cuda", None, "sd", False),
    ("cuda:0", "cuda:1", "ssd", False), ("cpu", None, "ssd", False)])
def test_an_ssd_draft_on_the_targets_gpu_is_advised_a_device_of_its_own(device, draft_device, mode, advised):
    from saguaro_dist.engine.build import shared_gpu_advice
    advice = shared_gpu_advice(Config(model="m", draft="d", mode=mode, device=device, draft_device=draft_device))
    assert (advice is not None) == advised
    assert advice is None or "--draft-device cuda:1" in advice and device in advice


@pytest.mark.parametrize("device, draft_device, want", [
    ("cuda", None, "thread"), ("cuda:0", "cuda", "thread"), ("cuda:1", "cuda:1", "thread"),
    ("cuda:0", "cuda:1", "process"), ("cuda", "cpu", "split"), ("cpu", "cpu", "split")])
def test_auto_ssd_draft_is_split_on_the_cpu_a_thread_on_the_targets_gpu_a_process_on_another(device, draft_device, want):
    """A draft on the CPU: split (trees in a process, off the target's GIL; just-in-time drafts on a thread).
    On the target's GPU: a thread on a stream of its own (two processes' kernels take turns on one GPU).
    On another GPU: a process."""
    from saguaro_dist.engine.build import draft_executor
    config = Config(model="m", draft="d", mode="ssd", device=device, draft_device=draft_device)
    assert draft_executor(config) is DraftExecutor(want)
    assert draft_executor(Config(model="m", draft="d", mode="sd", draft_executor="process")) is DraftExecutor.PROCESS


@pytest.mark.parametrize("mode, device, executor, want", [
    ("ssd", "cpu", "auto", "split"), ("ssd", "cuda", "auto", "process"), ("sd", "cpu", "auto", "process"),
    ("ssd", "cpu", "process", "process"), ("ssd", "cuda", "split", "split")])
def test_on_ray_auto_splits_ssd_on_the_cpu_and_leaves_gpus_to_the_pool(mode, device, executor, want):
    from saguaro_dist.engine.build import ray_draft_executor
    config = Config(model="m", draft="d", mode=mode, device=device, cluster="local", draft_executor=executor)
    assert ray_draft_executor(config) is DraftExecutor(want)


def test_serve_args_from_strings_like_serve_run_passes_them():
    c = config_from_args({"model": "m", "draft": "d", "k": "3", "fan_out": "2,2,2,2", "saguaro_c": "0.5",
                          "max_model_len": "200", "draft_resources": '{"saguaro_draft": 1}'})
    assert (c.k, c.fan_out, c.saguaro_c, c.max_model_len) == (3, (2, 2, 2, 2), 0.5, 200)
    assert c.draft_resources == {"saguaro_draft": 1}


@pytest.mark.parametrize("args, message", [
    ({"draft": "d"}, "need 'model'"), ({"model": "m", "beams": 4}, "unknown"), ({"model": "m", "k": "four"}, "k="),
])
def test_serve_args_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(args)


@pytest.mark.parametrize("bad", [-0.1, 2.0, "0.05", None])
def test_draft_spin_s_is_validated(bad):
    with pytest.raises(ValueError, match="draft_spin_s"):
        Config(model="m", draft="d", draft_spin_s=bad)


def test_a_cpu_draft_pool_can_serve_a_gpu_target():
    """draft_device: the draft's runner and its Ray actors follow it, the target keeps `device`."""
    from saguaro_dist.distributed.placement import draft_options, target_bundle
    config = Config(model="m", draft="d", device="cuda", draft_device="cpu")
    assert config.draft_device_resolved == "cpu" and Config(model="m", draft="d").draft_device_resolved == "cpu"
    assert target_bundle(config, {}) == {"GPU": 1}
    assert (draft_options(config, {})["num_gpus"], draft_options(config, {})["num_cpus"]) == (0, 1)
    same = Config(model="m", draft="d", device="cuda")
    assert (draft_options(same, {})["num_gpus"], draft_options(same, {})["num_cpus"]) == (1, 0)


def test_ngram_runs_without_a_draft_model():
    config = Config(model="m", mode="ngram")
    assert config.mode is Mode.NGRAM and not config.uses_draft
    assert Config(model="m", draft="d", mode="sd").uses_draft and Config(model="m", draft="d").uses_draft


def test_prompt_lookup_sizes_choose_the_ngram_matched():
    """In 5 1 2 7 9 2 7 1 2 the last 1-gram (2) last followed 7 -> 1; the last 2-gram (1 2) followed 7 -> 9;
    no earlier 3-gram: the last token repeated. The same sizes serve mode ngram and SSD's fast backup."""
    from saguaro_dist.engine.draftless import lookup_proposal
    tokens = [5, 1, 2, 7, 9, 2, 7, 1, 2]
    for low, high, want in ((1, 1, [7, 1]), (2, 3, [7, 9]), (3, 3, [2, 2])):
        config = Config(model="m", mode="ngram", k=2, prompt_lookup_min=low, prompt_lookup_max=high)
        assert lookup_proposal(tokens, config).tokens.tolist() == want


def test_prompt_lookup_flags_reach_the_config():
    import argparse

    from saguaro_dist.cli.serve import add_engine_args, engine_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = Config(**engine_args(parser.parse_args(["m", "--mode", "ngram", "--prompt-lookup-max", "5",
                                                     "--prompt-lookup-min", "2"])))
    assert (config.mode, config.prompt_lookup_max, config.prompt_lookup_min) == (Mode.NGRAM, 5, 2)


def test_ngram_rounds_from_the_api_and_the_cli():
    import argparse

    from saguaro_dist.cli.serve import add_engine_args, engine_args
    from saguaro_dist.engine.ssd_loop import gate_modes
    from saguaro_dist.spec.tree_gate import RoundMode
    assert RoundMode.FAST in gate_modes(Config(model="m", draft="d"))
    assert RoundMode.FAST not in gate_modes(Config(model="m", draft="d", ngram_rounds=False))
    assert RoundMode.FAST not in gate_modes(Config(model="m", draft="d", fallback="neural"))  # the draft's, forced
    with pytest.raises(ValueError, match="ngram_rounds"):
        Config(model="m", draft="d", ngram_rounds="no")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(engine_args(parser.parse_args(["--no-ngram-rounds"]))).ngram_rounds is False
    assert config_from_args(engine_args(parser.parse_args([]))).ngram_rounds is True
