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
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 0, 5]]


def cache_model(cache, repo_id: str, files, commit: str = COMMIT) -> None:
    """Copy `files` into the cache as the snapshot of `commit`, which the main branch names unless it
    already names another."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    if not (folder / "refs" / "main").exists():
        (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copy(f, snapshot / f.name)


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory):
    """(target, draft, another target: an older commit of tiny-org/target)"""
    root = tmp_path_factory.mktemp("hub_pair")
    target = save_model(root / "target", llama_config(6, 32, 2), seed=21)
    save_perturbed(root / "draft", target, seed=22, noise=0.3)
    save_model(root / "older", llama_config(6, 32, 2), seed=23)
    for name in ("target", "draft", "older"):
        save_tiny_tokenizer(root / name)
    return root / "target", root / "draft", root / "older"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, local_pair):
    """An offline Hub cache holding tiny-org/target, tiny-org/draft and tiny-org/weightless (no weights)."""
    cache = tmp_path / "hub"
    target, draft, older = local_pair
    cache_model(cache, "tiny-org/target", target.iterdir())
    cache_model(cache, "tiny-org/target", older.iterdir(), OTHER_COMMIT)
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


def test_a_revision_pins_the_commit(hub_cache, local_pair):
    """revision / draft_revision (vLLM's --revision): the older commit's weights, not main's."""
    with LLM(model=str(local_pair[2]), mode="ar") as llm:
        older = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    with LLM(model="tiny-org/target", revision=OTHER_COMMIT, mode="ar") as llm:
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == older
    with LLM(model="tiny-org/target", revision=OTHER_COMMIT, draft="tiny-org/target", draft_revision=COMMIT,
             mode="sd", k=2) as llm:
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == older


def test_a_revision_of_a_local_folder_is_a_clear_error(local_pair):
    with pytest.raises(ValueError, match="names a Hub revision.*local folder"):
        LLM(model=str(local_pair[0]), revision="main", mode="ar")
    with pytest.raises(ValueError, match="revision must be a branch, tag or commit"):
        Config(model="tiny-org/target", revision="", mode="ar")
