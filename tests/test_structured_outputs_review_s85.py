"""Structured outputs, review of session 85: a JSON schema's properties come out in the schema's order (as in
OpenAI's and vLLM's), vLLM's structured_outputs options are accepted at the values served and refused with a
clear message past them, and a model with no end-of-sequence token refuses a structured request up front
(llguidance would end the grammar with token 0, and the output filled up with it)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.structured import json_schema_of
from saguaro_dist.sampling_params import StructuredOutputsParams as SO
from saguaro_dist.serve.api import ServerOptions, create_app

# Both required, zeta first: llguidance writes required properties in the schema's order
ZETA_FIRST = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
# vLLM's StructuredOutputsParams options at their defaults, as a client serializing its dataclass sends them
VLLM_DEFAULT_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                        "whitespace_pattern": None, "structural_tag": None}


def no_eos_checkpoint(path) -> str:
    """The demo target with every end-of-sequence id taken out (config, generation config, tokenizer)."""
    shutil.copytree(demo_pair()[0], path)
    for name, drop in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                       ("tokenizer_config.json", "eos_token")):
        settings = json.loads((path / name).read_text())
        settings.pop(drop, None)
        (path / name).write_text(json.dumps(settings))
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo target (ar) and a copy with no EOS, each served on loopback: (llm, url, no-EOS llm, its url)."""
    llm = LLM(model=demo_pair()[0], mode="ar")
    no_eos = LLM(model=no_eos_checkpoint(tmp_path_factory.mktemp("no_eos") / "target"), mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("demo"))) as url, \
            serve_on_loopback(create_app(no_eos, ServerOptions("demo"))) as no_eos_url:
        yield llm, url, no_eos, no_eos_url
    llm.shutdown()
    no_eos.shutdown()


def chat(url: str, **extra) -> httpx.Response:
    body = {"model": "demo", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/chat/completions", json=body | extra, timeout=120)


def test_a_dict_schema_is_kept_in_its_own_order():
    assert SO(json=ZETA_FIRST).json == json.dumps(ZETA_FIRST)
    reordered = dict(reversed(list(ZETA_FIRST.items())))
    assert SO(json=reordered) != SO(json=ZETA_FIRST)  # two orders, two grammars: their outputs differ


def test_properties_come_out_in_the_schema_order(served):
    llm, url, _, _ = served
    for schema in (ZETA_FIRST, json.dumps(ZETA_FIRST)):
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(json=schema))
        assert llm.generate(["x = "], params, use_tqdm=False)[0].outputs[0].text.startswith('{"zeta"')
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": ZETA_FIRST}}
    reply = chat(url, response_format=response_format)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"zeta"')


def test_vllm_options_at_the_values_served_change_nothing(served):
    _, url, _, _ = served
    plain = chat(url, structured_outputs={"json": ZETA_FIRST})
    assert plain.status_code == 200, plain.text
    for options in (VLLM_DEFAULT_OPTIONS, {"disable_any_whitespace": True}):
        reply = chat(url, structured_outputs={"json": ZETA_FIRST, **options})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("option", [{"disable_additional_properties": True}, {"whitespace_pattern": " "},
                                    {"structural_tag": "{}"}])
def test_vllm_options_past_the_values_served_are_refused_clearly(served, option):
    _, url, _, _ = served
    reply = chat(url, structured_outputs={"json": ZETA_FIRST, **option})
    assert reply.status_code == 400
    assert f"{next(iter(option))} " in reply.json()["error"]["message"]
    assert "is not supported" in reply.json()["error"]["message"]
    with pytest.raises(ValueError, match=f"{next(iter(option))} .* is not supported"):
        SO(json=ZETA_FIRST, **option)


def test_offline_options_mirror_vllms():
    assert SO(regex="a+", **VLLM_DEFAULT_OPTIONS) == SO(regex="a+")
    with pytest.raises(ValueError, match="structural_tag 'x' is not supported"):
        SO(structural_tag="x")  # vLLM's sixth kind of constraint: refused as unsupported, not as "none given"
    with pytest.raises(ValueError, match="disable_any_whitespace must be a boolean"):
        SO(regex="a+", disable_any_whitespace="yes")


def test_disable_any_whitespace_wins_over_a_schemas_flexible_whitespace():
    flexible = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert json_schema_of(SO(json=flexible))["x-guidance"]["whitespace_flexible"] is True
    assert json_schema_of(SO(json=flexible, disable_any_whitespace=True))["x-guidance"]["whitespace_flexible"] is False


def test_a_model_without_eos_refuses_structured_outputs_up_front(served):
    _, _, no_eos, no_eos_url = served
    assert not no_eos.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=["pass", "return"]))
    with pytest.raises(ValueError, match="end-of-sequence token"):
        no_eos.generate(["x = "], params, use_tqdm=False)
    reply = chat(no_eos_url, guided_choice=["pass", "return"])
    assert reply.status_code == 400 and "end-of-sequence token" in reply.json()["error"]["message"]
    assert chat(no_eos_url).status_code == 200  # unconstrained requests are served as before
