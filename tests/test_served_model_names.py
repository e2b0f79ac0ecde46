"""Several --served-model-name (vLLM's): requests may give any of them, replies and metrics name the first."""
from __future__ import annotations

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.args import served_model_names

pytest_plugins = ["test_serve_fixtures"]


def test_names_from_flags_and_config_files():
    assert served_model_names(None, "/models/t") == ("/models/t",)
    assert served_model_names("qwen", "/models/t") == ("qwen",)
    assert served_model_names(["qwen", "gpt-4o"], "/models/t") == ("qwen", "gpt-4o")
    for bad in ("", ["qwen", ""], [3]):
        with pytest.raises(ValueError, match="served_model_name must be"):
            served_model_names(bad, "/models/t")
    options = server_options({"served_model_name": ["qwen", "gpt-4o"]}, "/models/t")
    assert (options.served_model_name, options.model_aliases) == ("qwen", ("gpt-4o",))


def test_any_name_answers_and_the_reply_names_the_first(serving_pair):
    with LLM(model=serving_pair[0], mode="ar") as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("qwen", model_aliases=("gpt-4o",)))) as url:
        models = httpx.get(f"{url}/models").json()["data"]
        body = {"prompt": "hello world", "max_tokens": 2}
        by_alias = httpx.post(f"{url}/completions", json={**body, "model": "gpt-4o"})
        other = httpx.post(f"{url}/completions", json={**body, "model": "other"})
    assert [m["id"] for m in models] == ["qwen", "gpt-4o"]
    assert by_alias.status_code == 200 and by_alias.json()["model"] == "qwen"
    assert other.status_code == 404


def test_an_empty_name_stops_the_server_before_ray(serving_pair, capsys):
    assert main(["serve", serving_pair[0], "--served-model-name", "qwen", ""]) == 2
    assert "served_model_name must be" in capsys.readouterr().err
