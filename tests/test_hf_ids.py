"""Hugging Face ids (owner/name) resolve through the Hub's cache: here a real cache folder laid out as
huggingface_hub writes it (models--owner--name/refs/main, snapshots/<commit>/), read offline, since no
weights can be downloaded here. What a driver reads of a model (config.json, tokenizer, generation
config) needs none of its weights."""
from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from engine_helpers import llama_config, save_model, save_perturbed
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import fit_draft
from saguaro_dist.model import ModelRunner, load_tokenizer
from test_engine_sampling import save_tiny_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 0, 5]]


def cache_model(cache, repo_id: str, files) -> None:
    """Copy `files` into the cache as the snapshot of repo_id's main branch."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copy(f, snapshot / f.name)


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_pair")
    target = save_model(root / "target", llama_config(6, 32, 2), seed=21)
    save_perturbed(root / "draft", target, seed=22, noise=0.3)
    for name in ("target", "draft"):
        save_tiny_tokenizer(root / name)
    return root / "target", root / "draft"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, local_pair):
    """An offline Hub cache holding tiny-org/target, tiny-org/draft and tiny-org/weightless (no weights)."""
    cache = tmp_path / "hub"
    target, draft = local_pair
    cache_model(cache, "tiny-org/target", target.iterdir())
    cache_model(cache, "tiny-org/draft", draft.iterdir())
    cache_model(cache, "tiny-org/weightless", [f for f in target.iterdir() if f.suffix != ".safetensors"])
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(huggingface_hub.constants, name, value)  # read once, when the hub is imported ...
        monkeypatch.setenv(name, str(int(value)) if value is True else value)  # ... so for child processes
    return cache


def test_a_pair_named_by_hub_ids_generates_what_the_local_folders_do(hub_cache, local_pair):
    with LLM(model=str(local_pair[0]), mode="ar") as llm:
        expected = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    with LLM(model="tiny-org/target", draft="tiny-org/draft", mode="ssd", k=2, fan_out=6,
             draft_executor="process") as llm:  # the child resolves the draft's id again
        assert llm.tokenizer is not None
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == expected


def test_what_a_driver_reads_needs_no_weights(hub_cache):
    tokenizer = load_tokenizer("tiny-org/weightless")
    assert len(tokenizer) == 6
    config = Config(model="tiny-org/weightless", draft="tiny-org/weightless", mode="ssd")
    assert fit_draft(config, tokenizer).vocab_size == 6  # the driver's check of a pair, before Ray starts
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ModelRunner("tiny-org/weightless")
