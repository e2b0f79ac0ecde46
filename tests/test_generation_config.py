"""Requests' sampling defaults from the model's generation_config.json (vLLM's --generation-config)."""
from __future__ import annotations

import shutil

import httpx
import pytest
from transformers import GenerationConfig

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli.serve import add_engine_args, engine_args
from saguaro_dist.model.loader import load_generation_defaults
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]

# top_k 1 makes the default greedy in effect, so a default request's reply is known exactly
QWEN_LIKE = dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=1, max_new_tokens=5)


def with_generation_config(model_dir, tmp_path, **fields) -> str:
    """A copy of a real checkpoint whose generation_config.json transformers wrote with these fields."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    GenerationConfig(bos_token_id=1, eos_token_id=2, **fields).save_pretrained(copy)
    return str(copy)


def test_the_fields_vllm_takes_under_our_names(tiny_checkpoint, tmp_path):
    model = with_generation_config(tiny_checkpoint("llama"), tmp_path, **QWEN_LIKE, repetition_penalty=1.1, min_p=0.05)
    assert load_generation_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 1, "max_tokens": 5,
                                               "repetition_penalty": 1.1, "min_p": 0.05}  # do_sample ignored
    assert load_generation_defaults(model, "vllm") == {}
    assert load_generation_defaults(tiny_checkpoint("draft"), model) == load_generation_defaults(model)  # a folder
    assert load_generation_defaults(tiny_checkpoint("draft")) == {}  # transformers' file, no sampling fields
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_generation_defaults(model, str(tmp_path))
    off = with_generation_config(tiny_checkpoint("llama"), tmp_path / "off", do_sample=True, top_k=-1)
    assert load_generation_defaults(off) == {"top_k": 0}  # transformers' -1 is our 0: no top-k


def test_generate_without_params_uses_them(tiny_checkpoint, tmp_path):
    model = with_generation_config(tiny_checkpoint("llama"), tmp_path, **QWEN_LIKE)
    prompt = [[3, 17, 42, 9]]
    with LLM(model=model, mode="ar") as llm:
        assert llm.default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, top_k=1, max_tokens=5)
        default = llm.generate(prompt_token_ids=prompt)[0]
        greedy = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=5))[0]
        assert default.token_ids == greedy.token_ids and len(default.token_ids) == 5
    with LLM(model=model, mode="ar", generation_config="vllm") as llm:
        assert llm.default_sampling_params() == SamplingParams()


def test_a_bad_generation_config_is_a_clear_error(tiny_checkpoint, tmp_path):
    model = with_generation_config(tiny_checkpoint("llama"), tmp_path, do_sample=True, top_p=0.9)
    (tmp_path / "model" / "generation_config.json").write_text('{"top_p": 2.0}')  # past what transformers writes
    with pytest.raises(ValueError, match="generation config of .* top_p"):
        LLM(model=model, mode="ar")
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(model=model, mode="ar", generation_config="")


def test_requests_fill_only_what_they_leave_out(serving_pair, tmp_path):
    model = with_generation_config(serving_pair[0], tmp_path, **QWEN_LIKE)
    with LLM(model=model, mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        def complete(**body) -> dict:
            reply = httpx.post(f"{url}/completions", json={"prompt": "hello world", "ignore_eos": True, **body}, timeout=60)
            assert reply.status_code == 200, reply.text
            return reply.json()

        def reference(**params) -> str:
            return llm.generate(["hello world"], SamplingParams(ignore_eos=True, **params))[0].text

        default = complete()
        assert default["usage"]["completion_tokens"] == 5  # max_new_tokens
        assert default["choices"][0]["text"] == reference(temperature=0, max_tokens=5)  # top_k 1: greedy
        assert complete(max_tokens=3)["usage"]["completion_tokens"] == 3
        # the request's top_k and temperature win; the model's top_p 0.9 still applies
        sampled = complete(top_k=0, temperature=1.0, seed=11)["choices"][0]["text"]
        assert sampled == reference(temperature=1.0, top_p=0.9, seed=11, max_tokens=5)


def test_the_flags(serving_pair):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args([serving_pair[0], "--generation-config", "vllm", "--max-num-seqs", "3", "-tp", "2"])
    args = engine_args(ns)
    assert (args["generation_config"], args["max_batch_size"], args["tensor_parallel_size"]) == ("vllm", 3, 2)
    ns = parser.parse_args([serving_pair[0], "--tensor-parallel-size", "2", "--max-batch-size", "4"])
    assert (engine_args(ns)["tensor_parallel_size"], engine_args(ns)["max_batch_size"]) == (2, 4)
