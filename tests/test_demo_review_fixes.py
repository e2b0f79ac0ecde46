"""Review fixes of the demo build: a resumed draft follows its teacher; bad --seed/--out/--work and budget
shares are refused before any work."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from saguaro_dist.cli import build_parser, main
from saguaro_dist.demo.build import build
from test_demo_build_edges import TINY, tiny


def weights(out, role: str) -> dict:
    return AutoModelForCausalLM.from_pretrained(out / role).state_dict()


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def parse(*argv: str):
    return build_parser().parse_args(["demo", "build", *argv])


@pytest.mark.slow  # three tiny builds (~14 s on a busy 2-core box)
def test_a_resume_that_trains_the_target_further_retrains_the_draft(tmp_path, caplog):
    """`--resume` with more target steps shipped the draft distilled from the old target: draft.pt's
    fingerprint left the teacher out, and a finished draft was not trained again (byte-identical draft)."""
    work = tmp_path / "work"
    build(TINY, out=tmp_path / "short", work=work)
    with caplog.at_level(logging.INFO, logger="saguaro_dist.demo.train"):
        longer = build(tiny(target_steps=5), out=tmp_path / "longer", work=work, resume=True)
    assert longer["steps"] == {"target": 5, "draft": 3}
    assert "another teacher; restarting it from step 0" in caplog.text
    assert not same_weights(weights(tmp_path / "short", "draft"), weights(tmp_path / "longer", "draft"))
    # the same teacher again (its digest survives the reload): the finished draft is resumed, not retrained
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="saguaro_dist.demo.train"):
        build(tiny(target_steps=5), out=tmp_path / "again", work=work, resume=True)
    assert "draft: resuming at step 3" in caplog.text and "another teacher" not in caplog.text
    assert same_weights(weights(tmp_path / "longer", "draft"), weights(tmp_path / "again", "draft"))


@pytest.mark.parametrize("seed", ["-1", str(2 * 10**13), "99999999999999999999"])
def test_cli_refuses_a_seed_torch_cannot_take(seed):
    """2e13 failed 36 s in (after the tokenizer and caches) with 'Overflow when unpacking long long'."""
    from saguaro_dist.cli.demo import recipe_from_args

    with pytest.raises(ValueError, match="--seed"):
        recipe_from_args(parse("--seed", seed))
    assert recipe_from_args(parse("--seed", str(10**13))).seed == 10**13


def test_the_largest_seed_allowed_draws_every_batch(tmp_path):
    from saguaro_dist.demo.build import BATCH_SEED_STRIDE, DRAFT_BATCH_OFFSET, MAX_SEED, batch_fn

    tokens = torch.arange(200, dtype=torch.int32)
    assert batch_fn(tiny(seed=MAX_SEED, seq_len=8), tokens, DRAFT_BATCH_OFFSET)(BATCH_SEED_STRIDE - 1).shape == (2, 9)
    with pytest.raises(ValueError, match="--seed"):
        build(tiny(seed=MAX_SEED + 1), out=tmp_path / "pair", work=tmp_path / "work")
    assert not (tmp_path / "work").exists()  # refused before any work


def test_cli_seed_error_names_the_flag(tmp_path, capsys):
    rc = main(["demo", "build", "--seed", "99999999999999999999", "--out", str(tmp_path / "o"),
               "--work", str(tmp_path / "w")])
    assert rc == 2 and "--seed" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before any work


@pytest.mark.parametrize("layout", ["same", "work_in_out", "out_in_work", "symlink"])
def test_out_and_work_must_not_overlap(tmp_path, layout):
    """--out X --work X built, but the next --resume refused X (work files in the pair folder) and a finished
    build's swap took the work caches with it."""
    d = tmp_path / "d"
    out, work = {"same": (d, d), "work_in_out": (d, d / "work"), "out_in_work": (d / "pair", d),
                 "symlink": (d, tmp_path / "link")}[layout]
    if layout == "symlink":
        d.mkdir()
        os.symlink(d, work)
    with pytest.raises(ValueError, match="overlap"):
        build(TINY, out=out, work=work)
    assert not (work / "tokenizer.json").exists() and not (out / "target").exists()


@pytest.mark.parametrize("share", [1.0, 0.0, float("nan")])
def test_a_minutes_budget_needs_a_share_for_each_model(tmp_path, share):
    """target_share=1.0 left the draft 0 s: a ZeroDivisionError after the whole target had trained."""
    from saguaro_dist.demo.build import budgets

    with pytest.raises(ValueError, match="target_share"):
        budgets(tiny(minutes=1.0, target_share=share))
    with pytest.raises(ValueError, match="target_share"):
        build(tiny(minutes=1.0, target_share=share), out=tmp_path / "pair", work=tmp_path / "work")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("flag", ["--out", "--work"])
@pytest.mark.parametrize("value", ["", "  "])
def test_cli_refuses_an_empty_folder(flag, value):
    """--out "" silently built into the packaged pair (args.out or PAIR_DIR); --work "" into the current folder."""
    from saguaro_dist.cli.demo import recipe_from_args

    with pytest.raises(ValueError, match=f"{flag} is empty"):
        recipe_from_args(parse(flag, value))
