"""Reviewer finds at the configuration / CLI edge (r9): a setting is applied or refused with a clear error,
never dropped; bad input fails before any run or model load, naming the flag the user gave."""
from __future__ import annotations

import argparse

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.config import Config
from saguaro_dist.serve.app import APP_IMPORT_PATH
from saguaro_dist.serve.config_file import load_serve_config
from saguaro_dist.speculative_config import config_fields


def _app(**extra) -> dict:
    return {"name": "saguaro", "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": {"k": 3}, **extra}


def _load(tmp_path, config: dict):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_serve_config(str(path))


def test_serve_config_env_vars_reach_the_app_an_api_key_is_never_dropped(tmp_path):
    """runtime_env env_vars were dropped: SAGUARO_API_KEY there left the server without auth."""
    from saguaro_dist.serve.app import server_options
    loaded = _load(tmp_path, {"applications": [_app(
        runtime_env={"env_vars": {"SAGUARO_API_KEY": "secret", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}},
        deployments=[{"name": "SaguaroServer", "num_replicas": 2, "max_queued_requests": 10,
                      "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"OTHER": "x"}}}}])]})
    assert server_options({**loaded.args, "model": "m"}, "m").api_key == ("secret",)
    assert loaded.args["allow_runtime_lora_updating"] is True
    options = loaded.deployment_options
    assert options["num_replicas"] == 2 and options["max_queued_requests"] == 10
    assert options["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "SAGUARO_API_KEY": "secret", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "OTHER": "x"}


@pytest.mark.parametrize("config, named", [
    ({"http_options": {"port": 8123, "request_timeout_s": 5}, "applications": [_app()]}, "request_timeout_s"),
    ({"proxy_location": "HeadOnly", "applications": [_app()]}, "proxy_location"),
    ({"logging_config": {"encoding": "JSON"}, "applications": [_app()]}, "--uvicorn-log-level"),
    ({"applications": [_app(deployments=[{"name": "SaguaroServer", "user_config": {"a": 1}}])]}, "user_config"),
    ({"applications": [_app(deployments=[{"name": "NotTheName", "num_replicas": 2}])]}, "'NotTheName'"),
    ({"applications": [_app(import_path="mypkg.app:build")]}, "not saguaro's"),
    ({"applications": [_app(), _app(name="b", route_prefix="/b")]}, "exactly one application"),
])
def test_serve_config_settings_not_applied_are_refused_by_name(tmp_path, config, named):
    with pytest.raises(ValueError, match="config .*") as err:
        _load(tmp_path, config)
    assert named in str(err.value)


def test_serve_config_route_prefix_is_applied(tmp_path):
    """A route_prefix other than "/" was refused; it is applied, as serve.run(route_prefix=...) does."""
    assert _load(tmp_path, {"applications": [_app(route_prefix="/my/prefix")]}).route_prefix == "/my/prefix"
    assert _load(tmp_path, {"applications": [_app()]}).route_prefix == "/"
    assert _load(tmp_path, {"applications": [{k: v for k, v in _app().items() if k != "route_prefix"}]}
                 ).route_prefix == "/"  # Serve's default


@pytest.mark.parametrize("prefix, problem", [("api", "must start with '/'"), ("/api/", "may not end with '/'"),
                                             ("/a{b}", "wildcards"), (None, "serves no HTTP route")])
def test_serve_config_route_prefix_breaking_ray_serve_rules_is_refused(tmp_path, prefix, problem):
    """Ray Serve's rules (a leading '/', no trailing one but "/", no wildcards), checked before Ray starts."""
    with pytest.raises(ValueError, match="application.route_prefix") as err:
        _load(tmp_path, {"applications": [_app(route_prefix=prefix)]})
    assert problem in str(err.value)


def test_serve_build_style_config_still_loads(tmp_path):
    """What `serve build` writes (its defaults stated) is what saguaro serve applies anyway."""
    loaded = _load(tmp_path, {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000},
                              "applications": [_app(name="app1", runtime_env={})]})
    assert (loaded.args, loaded.host, loaded.port, loaded.deployment_options) == ({"k": 3}, "0.0.0.0", 8000, {})


@pytest.mark.parametrize("flags, message", [
    (["--out", "{tmp}/a-file/x"], "a-file is a file, not a directory"),
    (["--sweep", "--sweep-ks", "2,0"], "sweep point k = 0"),
    (["--sweep", "--sweep-cs", "1.0,5"], "sweep point saguaro_c = 5.0"),
    (["--sweep", "--sweep-budgets", "3,12"], "--sweep-budgets 3"),
])
def test_bench_refuses_bad_out_and_sweep_values_before_any_run(tmp_path, capsys, flags, message):
    """They failed after the grid / several sweep points had run, nothing written (a missing pair is found only
    when the run starts: its error here would mean the check came too late)."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "no-model").mkdir()  # passes the bench's path check (a config.json), loads no model
    (tmp_path / "no-model" / "config.json").write_text("{}")
    argv = ["bench", "--preset", "quick", "--no-progress", "--target", str(tmp_path / "no-model"),
            "--draft", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
            *(flag.replace("{tmp}", str(tmp_path)) for flag in flags)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _engine_ns(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "hi", *flags])


@pytest.mark.parametrize("text, tokens", [("1k", 1000), ("1K", 1024), ("32k", 32000), ("2.5k", 2500), ("4096", 4096)])
def test_max_model_len_reads_vllms_sizes(text, tokens):
    assert _engine_ns("--max-model-len", text).max_model_len == tokens


def test_max_model_len_refuses_a_fraction_of_a_binary_size(capsys):
    with pytest.raises(SystemExit):
        _engine_ns("--max-model-len", "1.5K")
    assert "--max-model-len" in capsys.readouterr().err


@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_takes_vllms_aliases(alias, dtype):
    assert _engine_ns("--dtype", alias).dtype == dtype


def test_speculative_config_greedy_drafting_is_proposal_top_k_1():
    """vLLM's default draft_sample_method 'greedy' drafts the argmax against a one-hot q: top-1 proposals here
    (exact either way)."""
    fields = config_fields({"model": "D", "draft_sample_method": "greedy"}, {})
    assert fields == {"draft": "D", "proposal_top_k": 1}
    Config(model="T", mode="sd", **fields)  # a valid config
    assert config_fields({"model": "D", "draft_sample_method": "probabilistic"}, {})["proposal_top_k"] == 0
    assert "proposal_top_k" not in config_fields({"method": "ngram", "draft_sample_method": "greedy"}, {})
    with pytest.raises(ValueError, match="proposal_top_k=4 was given"):
        config_fields({"model": "D", "draft_sample_method": "greedy"}, {"proposal_top_k": 4})
    with pytest.raises(ValueError, match="'greedy' or 'probabilistic'"):
        config_fields({"model": "D", "draft_sample_method": "gumbel"}, {})


def test_generate_refuses_an_empty_prompt_before_loading(tmp_path, capsys):
    assert main(["generate", "--prompt", "", "--model", str(tmp_path / "no-model")]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


def test_k_past_the_fan_out_budget_is_worded_around_k():
    with pytest.raises(ValueError, match="k = 100000 needs that many \\(lower k, or raise fan_out: default 12\\)"):
        Config(model="T", draft="D", k=100000)


def test_demo_build_names_the_steps_flag_given(capsys):
    assert main(["demo", "build", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be positive" in err and "--target-steps" not in err
