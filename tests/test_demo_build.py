"""The demo build recipe, end to end in a tiny configuration (seconds), plus its parts."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saguaro_dist.cli import build_parser
from saguaro_dist.demo import corpus
from saguaro_dist.demo.build import Recipe, build
from saguaro_dist.demo.evaluate import matched
from saguaro_dist.demo.train import lr_at

TINY = Recipe(max_files=8, vocab_size=300, seq_len=64, batch_size=2, target_hidden=32, target_layers=1,
              target_heads=2, target_ffn=64, draft_hidden=16, draft_layers=1, draft_heads=1, draft_ffn=32,
              target_steps=3, draft_steps=3, warmup_steps=2, eval_prompts=2, eval_new_tokens=8,
              eval_windows=2, shipped_prompts=4, prompt_chars=200)


def write_tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_split_excludes_test_folders_and_is_by_file(tmp_path):
    body = "def f(x):\n    return x + 1\n"
    write_tree(tmp_path, {f"pkg/m{i}.py": body * (i + 1) for i in range(40)}
               | {"test/test_a.py": body, "idlelib/idle_test/t.py": body, "lib2to3/tests/t.py": body})
    split = corpus.split_corpus(tmp_path, heldout_percent=10)
    names = {p.relative_to(tmp_path).as_posix() for p in split.train + split.heldout}
    assert len(names) == 40 and all(n.startswith("pkg/") for n in names)
    assert not set(split.train) & set(split.heldout) and split.heldout
    assert split == corpus.split_corpus(tmp_path, heldout_percent=10)


def test_build_tiny_end_to_end(tmp_path):
    out, work = tmp_path / "pair", tmp_path / "work"
    report = build(TINY, out=out, work=work)
    assert report["steps"] == {"target": 3, "draft": 3}
    assert 0.0 <= report["greedy"]["acceptance"] <= 1.0
    tok = AutoTokenizer.from_pretrained(out / "draft")
    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(out / role)
        assert model.config.vocab_size == len(tok) and model.dtype == torch.float16
    assert len(json.loads((out / "prompts.json").read_text())) == 4
    assert json.loads((out / "build_info.json").read_text())["params"] == report["params"]
    # --resume with finished checkpoints trains nothing more and reproduces the same weights
    again = build(TINY, out=tmp_path / "again", work=work, resume=True)
    assert again["heldout_loss"] == report["heldout_loss"]


def test_minutes_budget_stops_on_time(tmp_path):
    report = build(Recipe(**{**TINY.__dict__, "minutes": 0.02}), out=tmp_path / "pair", work=tmp_path / "work")
    assert all(steps >= 1 for steps in report["steps"].values())


def test_resume_rejects_a_different_recipe(tmp_path):
    build(TINY, out=tmp_path / "pair", work=tmp_path / "work")
    with pytest.raises(ValueError, match="different recipe"):
        build(Recipe(**{**TINY.__dict__, "target_hidden": 48}), out=tmp_path / "x", work=tmp_path / "work", resume=True)


def test_lr_schedule_and_match_helpers():
    assert lr_at(0, 0.0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(10, 0.0, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(50, 0.5, 1.0, 10) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 1.0, 10) == pytest.approx(0.1)
    assert matched([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and matched([], [1]) == 0


def test_cli_parses_demo_build():
    args = build_parser().parse_args(["demo", "build", "--steps", "7", "--seed", "3", "--resume", "--out", "x"])
    assert (args.steps, args.seed, args.resume, args.out) == (7, 3, True, "x") and callable(args.run)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "build", "--steps", "1", "--minutes", "2"])


def test_cli_rejects_non_positive_steps():
    from saguaro_dist.cli.demo import recipe_from_args

    args = build_parser().parse_args(["demo", "build", "--steps", "0"])
    with pytest.raises(ValueError, match="positive"):
        recipe_from_args(args)


def test_greedy_with_its_kv_cache_is_transformers_greedy(tiny_checkpoint):
    """The acceptance measurement's own cached greedy loop against transformers' generate, without
    transformers' deprecation warning for the cache argument (removed in 5.40)."""
    import warnings

    from saguaro_dist.demo.evaluate import greedy
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama")).eval()
    ids = [1, 5, 9, 2, 7]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 5:].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert greedy(model, ids, 12, eos_id=-1) == want
