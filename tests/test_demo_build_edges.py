"""The demo build's edges: corpus stays machine-independent, resume state is checked, --out/--work refuse early."""
from __future__ import annotations

import dataclasses
import math
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saguaro_dist.cli import build_parser
from saguaro_dist.demo import corpus
from saguaro_dist.demo.build import Recipe, build

TINY = Recipe(max_files=8, vocab_size=300, seq_len=64, batch_size=2, target_hidden=32, target_layers=1,
              target_heads=2, target_ffn=64, draft_hidden=16, draft_layers=1, draft_heads=1, draft_ffn=32,
              target_steps=3, draft_steps=3, warmup_steps=2, eval_prompts=2, eval_new_tokens=8,
              eval_windows=2, shipped_prompts=4, prompt_chars=200)


def tiny(**changes) -> Recipe:
    return dataclasses.replace(TINY, **changes)


def write_tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def weights(out, role: str) -> dict:
    return AutoModelForCausalLM.from_pretrained(out / role).state_dict()


def test_corpus_skips_build_specific_files_and_symlinks(tmp_path):
    """_sysconfigdata*.py and config-*/python-config.py hold the build's paths and compiler flags, and a
    symlinked file (Debian's sitecustomize.py -> /etc/...) is distro config: all differ between machines
    running the same CPython, so the corpus (and the tokenizer) did too."""
    root, elsewhere = tmp_path / "lib", tmp_path / "etc"
    body = "def f(x):\n    return x + 1\n"
    write_tree(root, {"os.py": body, "json/decoder.py": body, "configparser.py": body,
                      "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {'prefix': '/root/x'}\n",
                      "config-3.11-x86_64-linux-gnu/python-config.py": body})
    write_tree(elsewhere, {"sitecustomize.py": "import apport\n"})
    os.symlink(elsewhere / "sitecustomize.py", root / "sitecustomize.py")
    names = [p.relative_to(root).as_posix() for p in corpus.list_sources(root)]
    assert names == ["configparser.py", "json/decoder.py", "os.py"]


def test_a_build_without_resume_starts_fresh(tmp_path):
    """Without --resume the work dir's old checkpoints were still loaded: a changed recipe failed with
    'build without --resume' (it was), and a matching one silently continued the old run."""
    work = tmp_path / "work"
    build(tiny(target_hidden=48), out=tmp_path / "old", work=work)
    assert build(TINY, out=tmp_path / "fresh", work=work)["steps"] == {"target": 3, "draft": 3}
    build(tiny(target_steps=5), out=tmp_path / "longer", work=work)
    build(tiny(target_steps=5), out=tmp_path / "clean", work=tmp_path / "clean-work")
    for role in ("target", "draft"):
        clean, longer = weights(tmp_path / "clean", role), weights(tmp_path / "longer", role)
        assert all(torch.equal(clean[k], longer[k]) for k in clean)


def test_resume_under_another_recipe_is_refused_before_any_checkpoint(tmp_path):
    """A run stopped after the tokenizer and token caches but before the first checkpoint: resuming it
    with another vocab silently trained on the cached tokenizer (vocab 280, asked 300)."""
    work = tmp_path / "work"
    with pytest.raises(ValueError, match="training stream"):
        build(tiny(vocab_size=280, seq_len=10**6), out=tmp_path / "a", work=work)
    assert (work / "tokenizer.json").exists() and not (work / "target.pt").exists()
    with pytest.raises(ValueError, match="different recipe"):
        build(TINY, out=tmp_path / "b", work=work, resume=True)


@pytest.mark.parametrize("name", ["draft.pt", "target.pt", "tokenizer.json", "train_tokens.pt", "recipe.json"])
def test_torn_resume_state_is_a_clear_error(tmp_path, built_work, name):
    work = tmp_path / "work"
    shutil.copytree(built_work, work)
    data = (work / name).read_bytes()
    (work / name).write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=rf"{name}.*(delete it|without --resume)"):
        build(TINY, out=tmp_path / "again", work=work, resume=True)


@pytest.fixture(scope="module")
def built_work(tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    build(TINY, out=root / "pair", work=root / "work")
    return root / "work"


def test_interrupted_loop_resumes_to_the_uninterrupted_weights(tmp_path):
    """Killed after step 3 of 6 (checkpoint every step), then resumed: bit-identical to one run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from saguaro_dist.demo.train import LoopSpec, run_loop, sample_batch, target_loss

    tokens = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    batches = lambda step: sample_batch(tokens, 2, 16, step)

    def killed(step):
        if step == 3:
            raise KeyboardInterrupt
        return batches(step)

    def run(ckpt, fn):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        run_loop(model, target_loss, fn, LoopSpec(role="t", ckpt=ckpt, total_steps=6, budget_s=None, lr=1e-2,
                                                  warmup=2, weight_decay=0.1, checkpoint_s=0.0, seed=0,
                                                  fingerprint={"r": 1}))
        return model.state_dict()

    whole = run(tmp_path / "a.pt", batches)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b.pt", killed)
    resumed = run(tmp_path / "b.pt", batches)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("flag", ["out", "work"])
def test_a_file_where_a_directory_belongs_is_refused_up_front(tmp_path, flag):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    dirs = {"out": tmp_path / "pair", "work": tmp_path / "work"} | {flag: taken}
    with pytest.raises(ValueError, match=f"--{flag}.*not a writable directory"):
        build(TINY, **dirs)
    assert taken.read_text() == "mine" and not (tmp_path / "pair" / "target").exists()


def test_an_unrelated_target_folder_in_out_is_not_deleted(tmp_path):
    """`--out .` in a Rust checkout: the export's rmtree of out/target took cargo's target/ with it."""
    out = tmp_path / "project"
    write_tree(out, {"target/debug/notes.txt": "keep me"})
    with pytest.raises(ValueError, match="not a model directory"):
        build(TINY, out=out, work=tmp_path / "work")
    assert (out / "target/debug/notes.txt").read_text() == "keep me"
    assert not (tmp_path / "work" / "target.pt").exists()  # refused before training


def test_a_symlinked_draft_folder_in_out_is_refused_before_training(tmp_path):
    """shutil.rmtree refuses a symlink: the export failed with an OSError after the whole build."""
    out, elsewhere = tmp_path / "pair", tmp_path / "models"
    write_tree(elsewhere, {"draft/config.json": "{}"})
    out.mkdir()
    os.symlink(elsewhere / "draft", out / "draft")
    with pytest.raises(ValueError, match="not a model directory"):
        build(TINY, out=out, work=tmp_path / "work")
    assert (elsewhere / "draft" / "config.json").exists()


def test_an_earlier_export_in_out_is_replaced(tmp_path):
    out = tmp_path / "pair"
    build(TINY, out=out, work=tmp_path / "w1")
    (out / "draft" / "stale.txt").write_text("old")
    build(tiny(seed=1), out=out, work=tmp_path / "w2")
    assert not (out / "draft" / "stale.txt").exists()
    assert AutoTokenizer.from_pretrained(out / "draft").decode([0]) == "<|bos|>"


@pytest.mark.parametrize("argv, match", [(["--minutes", "nan"], "minutes"), (["--minutes", "inf"], "minutes"),
                                         (["--minutes", "0"], "minutes"),
                                         (["--minutes", "5", "--draft-steps", "9"], "draft-steps")])
def test_cli_refuses_budgets_it_would_ignore_or_misread(argv, match):
    """--minutes nan ran zero steps and shipped an untrained pair; --draft-steps beside --minutes was dropped."""
    from saguaro_dist.cli.demo import recipe_from_args

    with pytest.raises(ValueError, match=match):
        recipe_from_args(build_parser().parse_args(["demo", "build", *argv]))
    assert math.isfinite(recipe_from_args(build_parser().parse_args(["demo", "build", "--minutes", "5"])).minutes)


def test_progress_never_shows_a_negative_share_done(tmp_path, capsys):
    build(TINY, out=tmp_path / "pair", work=tmp_path / "work")
    err = capsys.readouterr().err
    assert "train target" in err and "done=-" not in err
