"""Config and manifest-args edges (review h16): a value that cannot work is refused by name, with its range,
before any model loads or Ray starts; a value that works in any reasonable spelling is taken."""
from __future__ import annotations

import pytest

from saguaro_dist.config import Config, Mode
from saguaro_dist.serve.args import config_from_args

PAIR = dict(model="m", draft="d")


@pytest.mark.parametrize("mode", ["sd", "ngram"])
def test_k_past_the_default_fan_out_runs_the_modes_that_build_no_tree(mode):
    """fan_out shapes SSD's trees only: `--mode ngram --k 12` was refused for the default budget (12 < k+1), and
    the --fan-out that would have lifted it is refused with those modes (a dead end)."""
    kwargs = PAIR if mode == "sd" else dict(model="m")
    assert Config(**kwargs, mode=mode, k=12).k == 12


def test_ssd_still_needs_a_budget_that_covers_k():
    with pytest.raises(ValueError, match="fan_out budget must be an int >= k\\+1 = 13"):
        Config(**PAIR, mode="ssd", k=12)
    with pytest.raises(ValueError, match="fan_out"):
        Config(**PAIR, mode="sd", fan_out=0)  # still a positive int whatever the mode


@pytest.mark.parametrize("name", ["tree_timeout_s", "startup_timeout_s", "draft_deadline_s", "log_stats_interval_s"])
@pytest.mark.parametrize("value", [float("inf"), 1e300])
def test_a_timeout_too_large_to_wait_on_is_refused(name, value):
    """inf passed the >= 0 check and then raised OverflowError in the engine (threading waits, ray.get's
    milliseconds) mid-round or after Ray had started."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        Config(**PAIR, **{name: value})


def test_a_timeout_as_long_as_threads_can_wait_is_taken():
    import threading
    assert Config(**PAIR, startup_timeout_s=threading.TIMEOUT_MAX).startup_timeout_s == threading.TIMEOUT_MAX


@pytest.mark.parametrize("name", ["target_resources", "draft_resources"])
def test_an_infinite_resource_amount_is_refused(name):
    with pytest.raises(ValueError, match=name):
        Config(**PAIR, cluster="auto", **{name: {"accel": float("inf")}})


@pytest.mark.parametrize("key", ["CPU", "GPU"])
def test_draft_resources_may_not_name_cpu_or_gpu(key):
    """Ray refuses them in an actor's custom resources (num_cpus / num_gpus are their keywords), after Ray
    started; the draft's CPUs and GPU come from draft_threads and draft_device."""
    with pytest.raises(ValueError, match="draft_resources.*draft_threads.*draft_device"):
        Config(**PAIR, cluster="auto", draft_resources={key: 1})


def test_target_resources_are_copied_not_shared_with_the_caller():
    given = {"accel": 1}
    config = Config(**PAIR, target_resources=given)
    given["accel"] = 99
    assert config.target_resources == {"accel": 1}


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2), dict(num_draft_workers=2)])
def test_ranks_or_draft_workers_without_a_cluster_are_refused(kwargs):
    """The one-host engine (cluster=None) ran one rank and one draft whatever these said, silently."""
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} = 2 runs on Ray: give cluster"):
        Config(**PAIR, **kwargs)
    assert Config(**PAIR, cluster="auto", **kwargs).cluster == "auto"


@pytest.mark.parametrize("args", [{"tensor_parallel_size": "2"}, {"num_draft_workers": 2}])
def test_a_manifest_with_ranks_or_draft_workers_runs_the_engine_on_its_cluster(args):
    """A Serve / KubeRay manifest names its pools (deploy/kuberay/rayservice.yaml: tensor_parallel_size 2,
    num_draft_workers 2) and no cluster: its engine ran on one host inside the replica. As the CLI's flags do,
    more than one rank or draft worker means the cluster the app runs on."""
    assert config_from_args({**PAIR, **args}).cluster == "auto"
    assert config_from_args({**PAIR, **args, "cluster": "ray://head:10001"}).cluster == "ray://head:10001"
    assert config_from_args(PAIR).cluster is None  # one rank, one draft: the one-host engine, as before


@pytest.mark.parametrize("mode", ["sd", "ngram"])
def test_a_k_longer_than_max_model_len_is_taken(mode):
    """Once refused ("k = 8 leaves no room in max_model_len = 10"): the speculative modes stopped K + 1 tokens
    before the context's end. The target's position slack now holds a round's positions past it
    (tests/test_context_end.py), so every mode takes what ar takes."""
    kwargs = PAIR if mode == "sd" else dict(model="m")
    assert Config(**kwargs, mode=mode, k=8, max_model_len=10).k == 8
    assert Config(**kwargs, mode=mode, k=7, max_model_len=2).k == 7
    assert Config(model="m", mode="ar", k=8, max_model_len=10).mode is Mode.AR  # ar scores no speculation


@pytest.mark.parametrize("text", ["flase", "", "2", "enabled"])
def test_a_manifest_boolean_that_is_no_boolean_is_refused(text):
    """Anything but a true spelling read as False: `adaptive_fan_out: flase` turned it off, silently."""
    with pytest.raises(ValueError, match=f"app argument adaptive_fan_out={text!r}: adaptive_fan_out must be true or "
                                         f"false \\(yes / no, on / off, 1 / 0\\)"):
        config_from_args({**PAIR, "adaptive_fan_out": text})


@pytest.mark.parametrize("text, value", [("true", True), ("True", True), ("yes", True), ("1", True), ("on", True),
                                         ("false", False), ("FALSE", False), ("no", False), ("0", False), ("off", False)])
def test_a_manifest_boolean_takes_the_usual_spellings(text, value):
    assert config_from_args({**PAIR, "adaptive_fan_out": text}).adaptive_fan_out is value


@pytest.mark.parametrize("name, text, message", [
    ("k", "four", "k='four': k must be an integer$"),
    ("k", "4.0", "k='4.0': k must be an integer$"),
    ("max_model_len", "2k", "max_model_len='2k': max_model_len must be an integer$"),
    ("saguaro_c", "half", "saguaro_c='half': saguaro_c must be a number$"),
    ("tree_timeout_s", "5s", "tree_timeout_s='5s': tree_timeout_s must be a number$"),
    ("fan_out", "4,x", "fan_out='4,x': fan_out must be an integer or comma-separated integers$"),
    ("target_resources", "{bad", "target_resources='{bad': target_resources must be a JSON object$"),
])
def test_a_manifest_value_that_is_no_number_names_the_field_and_what_it_takes(name, text, message):
    """It read "invalid literal for int() with base 10: 'four'" (or json's "Expecting property name"): Python's
    words, not what the field takes."""
    with pytest.raises(ValueError, match=message):
        config_from_args({**PAIR, name: text})


def test_log_requests_spelt_wrong_is_refused_by_name():
    """serve/app.py reads log_requests with the same coerce: a typo turned request logging off."""
    from saguaro_dist.serve.args import coerce
    with pytest.raises(ValueError, match="log_requests must be true or false"):
        coerce("log_requests", "ture", False)


@pytest.mark.parametrize("args, field, value", [
    ({"k": "4"}, "k", 4), ({"k": " 6 "}, "k", 6), ({"mode": Mode.SD}, "mode", Mode.SD), ({"mode": "sd"}, "mode", Mode.SD),
    ({"fan_out": "4,3,2,1,1"}, "fan_out", (4, 3, 2, 1, 1)), ({"max_model_len": "null"}, "max_model_len", None),
    ({"saguaro_c": "0.5"}, "saguaro_c", 0.5), ({"target_resources": '{"accel": 1}'}, "target_resources", {"accel": 1}),
])
def test_a_manifest_value_in_any_reasonable_spelling_is_taken(args, field, value):
    assert getattr(config_from_args({**PAIR, **args}), field) == value
