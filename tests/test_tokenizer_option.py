"""`tokenizer` (vLLM's --tokenizer): a tokenizer from elsewhere, for checkpoints that ship none or whose
own one is not the one to use. Text in and out, chat templates, EOS and the pair's vocabulary check all
go through it; a named tokenizer that does not load fails at start-up, never at the first request."""
from __future__ import annotations

import shutil

import pytest
import yaml

from engine_helpers import llama_config, save_model, save_perturbed
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import main
from saguaro_dist.cli.serve import add_engine_args, engine_args
from saguaro_dist.config import Config
from saguaro_dist.engine.build import fit_draft, target_tokenizer
from saguaro_dist.serve.args import config_from_args
from test_engine_sampling import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TEXTS = ["abc", "edda"]
CHAT = [{"role": "user", "content": "ab"}]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A target and a draft without tokenizer files, a tokenizer folder, and the target with it copied in."""
    root = tmp_path_factory.mktemp("bare_pair")
    target = save_model(root / "target", llama_config(6, 32, 2), seed=41)
    save_perturbed(root / "draft", target, seed=42, noise=0.3)
    save_model(root / "wide_draft", llama_config(8, 16, 1), seed=43)  # 2 padding rows more than the target
    save_tiny_tokenizer(root / "tokenizer")
    shutil.copytree(root / "target", root / "target_with_tokenizer")
    save_tiny_tokenizer(root / "target_with_tokenizer")
    return {name: str(root / name) for name in ("target", "draft", "wide_draft", "tokenizer", "target_with_tokenizer")}


def test_the_tokenizer_comes_from_the_model_unless_one_is_named():
    assert Config(model="m", mode="ar", revision="v1").tokenizer_source == ("m", "v1")
    assert Config(model="m", mode="ar", revision="v1", tokenizer_revision="v2").tokenizer_source == ("m", "v2")
    assert Config(model="m", mode="ar", revision="v1", tokenizer="org/tok").tokenizer_source == ("org/tok", None)
    with pytest.raises(ValueError, match="tokenizer must be"):
        Config(model="m", mode="ar", tokenizer=" ")


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_bare_checkpoint_speaks_text_through_the_named_tokenizer(bare, mode):
    with LLM(model=bare["target_with_tokenizer"], mode="ar") as llm:
        expected = [(o.token_ids, o.text) for o in llm.generate(TEXTS, GREEDY)]
        expected_chat = llm.chat(CHAT, GREEDY)[0].token_ids
    draft = {"draft": bare["draft"], "k": 2, "fan_out": 6} if mode == "ssd" else {}
    with LLM(model=bare["target"], tokenizer=bare["tokenizer"], mode=mode, **draft) as llm:
        assert [(o.token_ids, o.text) for o in llm.generate(TEXTS, GREEDY)] == expected
        assert llm.chat(CHAT, GREEDY)[0].token_ids == expected_chat


def test_a_named_tokenizer_that_does_not_load_fails_at_start_up(bare, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        LLM(model=bare["target"], tokenizer=str(tmp_path / "empty"), mode="ar")
    with pytest.raises(ValueError, match="could not be loaded"):
        target_tokenizer(Config(model=bare["target"], mode="ar", tokenizer="not-an/org-offline", revision=None))


def test_a_draft_without_a_tokenizer_is_taken_to_speak_the_named_one(bare):
    """Padding rows are matched only with proof that one tokenizer serves both: naming it is that proof."""
    config = Config(model=bare["target"], draft=bare["wide_draft"], mode="ssd", tokenizer=bare["tokenizer"])
    assert fit_draft(config, target_tokenizer(config)).vocab_size == 6
    unnamed = Config(model=bare["target"], draft=bare["wide_draft"], mode="ssd")
    with pytest.raises(ValueError, match="without both tokenizers"):
        fit_draft(unnamed, target_tokenizer(unnamed))


def test_the_flags_reach_the_engine_config(bare, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "org/m", "--tokenizer", "org/tok", "--tokenizer-revision", "v3"])
    config = config_from_args(engine_args(ns))
    assert (config.tokenizer, config.tokenizer_revision) == ("org/tok", "v3")
    assert main(["deploy", "k8s", "--kind", "serve-config", "--tokenizer", "org/tok", "--tokenizer-revision", "v3"]) == 0
    config = config_from_args(yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"])
    assert (config.tokenizer, config.tokenizer_revision) == ("org/tok", "v3")


def test_on_ray_the_target_rank_speaks_the_named_tokenizer(bare, ray_cluster):
    with LLM(model=bare["target_with_tokenizer"], mode="ar") as llm:
        expected = [o.token_ids for o in llm.generate(TEXTS, GREEDY)]
    with LLM(model=bare["target"], draft=bare["draft"], tokenizer=bare["tokenizer"], mode="ssd", k=2, fan_out=6,
             cluster="local", startup_timeout_s=120) as llm:
        assert [o.token_ids for o in llm.generate(TEXTS, GREEDY)] == expected
