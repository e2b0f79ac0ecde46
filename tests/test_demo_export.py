"""The demo build's prompt sampling and export: a held-out set with no prompt that fits is a clear error (it looped
forever), and an export that fails part-way leaves the earlier pair whole (it left a new target beside the old
draft). Real tiny Llama models and a real trained BPE tokenizer."""
from __future__ import annotations

import hashlib

import pytest
import torch
from demo_fixtures import SOURCE, files, tiny_model
from transformers import AutoModelForCausalLM

from saguaro_dist.demo import corpus
from saguaro_dist.demo.build import Recipe, build, export_pair

pytest_plugins = ["demo_fixtures"]
LONG_LINES = "".join(f"value_{i} = '{'x' * 300}'\n" for i in range(20))  # every line longer than 200 characters
SAMPLED_SHA = "c19aef6a52ad749e"  # sample_snippets([SOURCE, LONG_LINES], 6, 200, seed=3) before this change


@pytest.mark.timeout(10)
@pytest.mark.parametrize("texts, max_chars", [([LONG_LINES], 200), (["\n" * 4 + "x = 1\n" * 20], 0),
                                               (["   \n" * 30], 1000)])
def test_no_window_that_fits_is_a_clear_error_not_an_endless_loop(texts, max_chars):
    with pytest.raises(ValueError, match="prompt_chars"):
        corpus.sample_snippets(texts, n=4, max_chars=max_chars, seed=0)


def test_sampling_is_unchanged_where_windows_fit():
    """The check draws nothing: the shipped pair's prompts (and any build's) stay the same."""
    got = corpus.sample_snippets([SOURCE, LONG_LINES], n=6, max_chars=200, seed=3)
    assert got == corpus.sample_snippets([SOURCE, LONG_LINES], n=6, max_chars=200, seed=3)
    assert len(got) == 6 and all(0 < len(s) <= 200 and s.strip() for s in got)
    assert hashlib.sha256("\x00".join(got).encode()).hexdigest()[:16] == SAMPLED_SHA


@pytest.mark.timeout(30)
def test_a_corpus_without_a_fitting_prompt_is_refused_before_training(tmp_path):
    """The build sampled its prompts after training and the export: an endless loop hours in."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(4):
        (root / f"m{i}.py").write_text(LONG_LINES)
    recipe = Recipe(corpus_root=str(root), vocab_size=300, seq_len=64, batch_size=2, target_hidden=32, target_layers=1,
                    target_heads=2, target_ffn=64, draft_hidden=16, draft_layers=1, draft_heads=1, draft_ffn=32,
                    target_steps=1, draft_steps=1, warmup_steps=1, eval_prompts=2, eval_new_tokens=8, eval_windows=2,
                    shipped_prompts=4, prompt_chars=200)
    with pytest.raises(ValueError, match="prompt_chars"):
        build(recipe, out=tmp_path / "out", work=tmp_path / "work")
    assert not (tmp_path / "work" / "tokenizer.json").exists() and not (tmp_path / "out" / "target").exists()


def test_an_export_failing_part_way_leaves_the_earlier_pair_whole(tmp_path, fast_tok):
    """The draft's save failing after the target's was written (a kill, a full disk): out/target held the new
    target and out/draft the old draft, a pair no build made."""
    out = tmp_path / "pair"
    out.mkdir()
    export_pair({"target": tiny_model(0), "draft": tiny_model(1)}, fast_tok, out)
    before = files(out)
    with pytest.raises(AttributeError):
        export_pair({"target": tiny_model(2), "draft": None}, fast_tok, out)  # the draft's save fails
    assert files(out) == before  # the old pair, whole; no staging folder left behind


def test_an_export_replaces_the_pair_and_drops_a_killed_export_s_leftovers(tmp_path, fast_tok):
    out = tmp_path / "pair"
    (out / ".export-killed" / "target").mkdir(parents=True)
    (out / "draft").mkdir()
    (out / "draft" / "stale.txt").write_text("old")
    models = {"target": tiny_model(0), "draft": tiny_model(1)}
    export_pair(models, fast_tok, out)
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]
    assert not (out / "draft" / "stale.txt").exists()
    for role in ("target", "draft"):
        reloaded = AutoModelForCausalLM.from_pretrained(out / role).state_dict()
        for name, weight in models[role].state_dict().items():  # fp16 on disk, as before
            assert torch.equal(reloaded[name], weight.to(torch.float16).to(torch.float32)), name
