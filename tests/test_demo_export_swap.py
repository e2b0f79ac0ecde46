"""The demo export swaps the whole pair folder in one step. It swapped out/target and out/draft by four renames:
a build killed between them left (and a reader loading the pair meanwhile saw) a new target beside the old draft,
or no target at all. Kills are real: a forked child that runs the real export on the real filesystem and _exits
at its n-th filesystem mutation (no finally block, no rollback runs), for every n until the export completes."""
from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import stat

import pytest
import torch
from demo_fixtures import files, tiny_model

import saguaro_dist.demo.export as demo_export  # exchange_dirs is looked up there by swap_in
from saguaro_dist.demo.build import Recipe, build, check_out, export_pair

pytest_plugins = ["demo_fixtures"]
KILLED = 77  # the child's exit code when the simulated kill hit
TINY = Recipe(max_files=8, vocab_size=300, seq_len=64, batch_size=2, target_hidden=32, target_layers=1,
              target_heads=2, target_ffn=64, draft_hidden=16, draft_layers=1, draft_heads=1, draft_ffn=32,
              target_steps=3, draft_steps=3, warmup_steps=2, eval_prompts=2, eval_new_tokens=8,
              eval_windows=2, shipped_prompts=4, prompt_chars=200)


def pair_files(out) -> dict[str, bytes]:
    """What a reader of the pair sees: every file under out/target and out/draft."""
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for role in ("target", "draft") for p in sorted((out / role).rglob("*")) if p.is_file()}


def kill_at(n: int) -> None:
    """In the child: the n-th rename, swap or delete never happens; the process dies there."""
    calls = [0]

    def lethal(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os._exit(KILLED)
            return real(*args, **kwargs)
        return call

    for module, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree"), (demo_export, "exchange_dirs")):
        if hasattr(module, name):  # exchange_dirs: absent before the whole-folder swap
            setattr(module, name, lethal(getattr(module, name)))


def no_exchange(a, b):
    raise OSError(errno.EINVAL, "Invalid argument")


def export_killed_at(n: int, models: dict, fast_tok, out, exchange_supported: bool) -> int:
    def child():
        torch.set_num_threads(1)
        if not exchange_supported:
            demo_export.exchange_dirs = no_exchange  # before kill_at wraps it: a filesystem without RENAME_EXCHANGE
        kill_at(n)
        export_pair(models, fast_tok, out)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    return proc.exitcode


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, fast_tok):
    """An earlier export (old), and what the new export writes when nothing kills it (new)."""
    root = tmp_path_factory.mktemp("pairs")
    new_models = {"target": tiny_model(2), "draft": tiny_model(3)}
    for name in ("old", "new"):
        (root / name).mkdir()
    export_pair({"target": tiny_model(0), "draft": tiny_model(1)}, fast_tok, root / "old")
    export_pair(new_models, fast_tok, root / "new")
    return root / "old", pair_files(root / "old"), pair_files(root / "new"), new_models


def kill_at_every_step(tmp_path, fast_tok, pairs, exchange_supported: bool, after_kill=lambda out: None) -> int:
    template, old, new, new_models = pairs
    assert old != new
    for n in range(1, 40):
        out = tmp_path / f"kill{n}" / "pair"
        shutil.copytree(template, out)
        code = export_killed_at(n, new_models, fast_tok, out, exchange_supported)
        assert code in (0, KILLED), f"the export failed (exit {code}) at kill point {n}"
        after_kill(out)
        seen = pair_files(out)
        assert seen == old or seen == new, f"killed at mutation {n}: a torn pair {sorted(seen)}"
        if code == 0:
            assert seen == new
            return n
    raise AssertionError("the export never completed")


@pytest.mark.timeout(240)
def test_a_kill_at_any_step_of_the_export_leaves_the_old_pair_or_the_new(tmp_path, fast_tok, pairs):
    """Killed between its renames the export left no out/target (kill point 2) or the new target beside the old
    draft (kill point 3); now the one swap makes the old pair or the new one the pair, at every moment."""
    kill_at_every_step(tmp_path, fast_tok, pairs, exchange_supported=True)


@pytest.mark.timeout(240)
def test_without_an_atomic_swap_the_next_build_restores_a_whole_pair(tmp_path, fast_tok, pairs):
    """On a filesystem without RENAME_EXCHANGE the folder is replaced in two renames; a kill between them leaves
    no pair folder, and the next build's first check (check_out) puts the previous pair back before anything."""
    kill_at_every_step(tmp_path, fast_tok, pairs, exchange_supported=False, after_kill=check_out)


def test_the_export_leaves_no_staging_folder_and_keeps_the_folder_s_mode(tmp_path, fast_tok):
    """The staging folder becomes the pair folder: a mkdtemp stage would have made it 0700, unreadable by
    the other users of a shared install."""
    out = tmp_path / "pair"
    out.mkdir(mode=0o751)
    out.chmod(0o751)
    export_pair({"target": tiny_model(0), "draft": tiny_model(1)}, fast_tok, out)
    export_pair({"target": tiny_model(2), "draft": tiny_model(3)}, fast_tok, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair"]
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]


def test_a_symlinked_out_stays_a_link_to_the_new_pair(tmp_path, fast_tok):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    export_pair({"target": tiny_model(0), "draft": tiny_model(1)}, fast_tok, real)
    link.symlink_to(real, target_is_directory=True)
    export_pair({"target": tiny_model(2), "draft": tiny_model(3)}, fast_tok, link)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert pair_files(link) == pair_files(real) and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.timeout(120)
def test_a_build_failing_in_its_measurement_leaves_the_earlier_build_whole(tmp_path, monkeypatch):
    """The pair was swapped in before the held-out measurement: a failure there (or a kill) left the new models
    with the new prompts.json beside the earlier build's build_info.json. Now all of it lands together."""
    from saguaro_dist.demo import evaluate

    out = tmp_path / "pair"
    build(TINY, out=out, work=tmp_path / "w1")
    before = files(out)
    assert {"prompts.json", "build_info.json", "target/model.safetensors"} <= before.keys()

    def broken(*args, **kwargs):
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(evaluate, "greedy_acceptance", broken)
    with pytest.raises(RuntimeError, match="measurement failed"):
        build(Recipe(**{**TINY.__dict__, "seed": 1}), out=out, work=tmp_path / "w2")
    assert files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair", "w1", "w2"]  # no staging folder left


def test_an_out_holding_other_files_is_refused_before_training(tmp_path):
    """The export replaces the whole folder: anything else in it would go with the old pair."""
    out = tmp_path / "pair"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="--out .* holds more than a demo pair .*notes.txt"):
        build(TINY, out=out, work=tmp_path / "work")
    assert (out / "notes.txt").read_text() == "keep me" and not (tmp_path / "work" / "target.pt").exists()


def test_resume_with_nothing_to_resume_says_so(tmp_path, caplog):
    """A mistyped --work with --resume silently started the whole build over (90 minutes at the recipe's size)."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.demo.build"):
        build(TINY, out=tmp_path / "pair", work=tmp_path / "typo", resume=True)
    assert any("nothing to resume" in r.getMessage() for r in caplog.records)


def test_an_interrupted_build_says_how_to_resume(tmp_path, monkeypatch, caplog):
    """Ctrl-C ended `saguaro demo build` with exit 130 and not a word: nothing said that --resume keeps the
    checkpoints. The interrupt is injected where the build reads its corpus (a real KeyboardInterrupt)."""
    from saguaro_dist.cli import main
    from saguaro_dist.demo import corpus

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "split_corpus", interrupted)
    work = tmp_path / "work"
    with caplog.at_level(logging.WARNING):
        assert main(["demo", "build", "--out", str(tmp_path / "pair"), "--work", str(work)]) == 130
    assert any("--resume" in r.getMessage() and str(work) in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not os.path.ismount("/dev/shm"), reason="needs a mount point to point --out at")
def test_a_mount_point_out_is_refused_before_training():
    """A mount point (a container's volume) cannot be renamed: the swap would fail after the whole build."""
    from pathlib import Path

    from saguaro_dist.demo.build import check_swappable

    with pytest.raises(ValueError, match="mount point"):
        check_swappable(Path("/dev/shm"))
