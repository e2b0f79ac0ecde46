"""Review of `saguaro bench` and the demo (session 86): a serving stream runs on its own system's CPUs, a bad
--target is a clear error, --num-prompts is checked against the batch sizes the run runs, empty lists are
refused, a sweep's bad value is named, and the demo prompts hold no repeats. Real tiny checkpoints, real engines."""
from __future__ import annotations

import json
import math
import os

import pytest

from saguaro_dist.bench import BenchConfig, SweepConfig, serving
from saguaro_dist.bench.affinity import host_cpus
from saguaro_dist.bench.runner import sweep_point_configs
from saguaro_dist.cli import main
from saguaro_dist.demo import PAIR_DIR, corpus


def _threads_cpus() -> set[tuple[int, ...]]:
    """The CPU sets of this process's threads (pinning sets every one)."""
    tids = os.listdir(f"/proc/{os.getpid()}/task")
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids}


@pytest.mark.skipif(len(host_cpus()) < 2 or not os.path.isdir("/proc"), reason="pinning needs 2 CPUs and /proc")
def test_each_serving_stream_runs_on_its_own_system_s_cpus(tiny_llama_pair, tmp_path, monkeypatch):
    """Every system is open at once and each open() pinned the process: every stream ran on the CPUs of the
    system opened last (ar's one core for ssd-thread's stream)."""
    seen = []
    stream = serving.serve_stream

    def recording(llm, *args, **kwargs):  # the real stream, with the CPUs it starts on
        seen.append((str(getattr(llm.config.mode, "value", llm.config.mode)), _threads_cpus()))
        return stream(llm, *args, **kwargs)
    monkeypatch.setattr(serving, "serve_stream", recording)
    base = BenchConfig(target=tiny_llama_pair[0], draft=tiny_llama_pair[1], systems=("ssd-thread", "ar"),
                       settings=("paper",), batch_sizes=(2,), temperatures=(0.0,), max_new_tokens=4, prompt_len=6,
                       k=2, fan_out=6, out_dir=str(tmp_path))
    results = serving.run_serving(serving.ServingConfig(base=base, rates=(math.inf,), num_requests=2), progress=False)
    assert results["errors"] == []
    pins = {c["system"]: c["placement"]["pinning"] for c in results["cells"]}
    # neither has a draft child process: its bench process holds its target's and draft's CPUs
    want = {"ssd": {tuple(sorted({*pins["ssd-thread"]["target_cpus"], *pins["ssd-thread"]["draft_cpus"]}))},
            "ar": {tuple(pins["ar"]["target_cpus"])}}
    assert want["ssd"] != want["ar"]
    assert len(seen) == 4  # a warm-up and a timed stream each
    assert all(cpus == want[mode] for mode, cpus in seen), seen


def _bench(tmp_path, *flags) -> int:
    return main(["bench", *map(str, flags), "--out", str(tmp_path / "out"), "--no-plots", "--no-progress"])


def test_a_missing_checkpoint_is_a_clear_error_and_a_hub_id_passes(tiny_llama_pair, tmp_path, capsys):
    """A bad --target raised a FileNotFoundError traceback once the run read its config.json."""
    code = _bench(tmp_path, "--target", "/nonexistent/t", "--draft", tiny_llama_pair[1], "--systems", "ar,sd",
                  "--batch", "1", "--max-new-tokens", "2")
    assert code == 2 and "--target /nonexistent/t: no such folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--draft .* holds no config.json"):
        BenchConfig(target=tiny_llama_pair[0], draft=str(tmp_path))
    for bad in ("./t", "a/b/c", "org/", "t"):
        with pytest.raises(ValueError, match="not a Hugging Face id"):
            BenchConfig(target=bad, draft=tiny_llama_pair[1])
    assert BenchConfig(target="Qwen/Qwen3-0.6B", draft=tiny_llama_pair[1]).target == "Qwen/Qwen3-0.6B"  # the loader's


def test_num_prompts_is_checked_against_the_run_s_own_batch_sizes():
    """`--sweep --num-prompts 4` was refused against the grid's batch sizes (up to 8), which a sweep never runs;
    and a sweep batch over --num-prompts raised the prompt count silently."""
    sweep = SweepConfig(base=BenchConfig(num_prompts=4))
    assert sweep.prompt_count == 4
    assert SweepConfig(base=BenchConfig()).prompt_count == 16  # the default, as before
    assert SweepConfig(base=BenchConfig(), batch_size=32).prompt_count == 32
    with pytest.raises(ValueError, match="sweep's batch size"):
        SweepConfig(base=BenchConfig(num_prompts=4), batch_size=8)
    with pytest.raises(ValueError, match="largest batch size"):
        BenchConfig(num_prompts=4).prompt_count  # the grid's (1, 2, 4, 8)
    with pytest.raises(ValueError, match="num_prompts"):
        BenchConfig(num_prompts=0)


@pytest.mark.parametrize("flag", ["--systems", "--temperatures", "--settings"])
def test_an_empty_list_is_refused(flag, tiny_llama_pair, tmp_path, capsys):
    """`--systems ,` ran nothing and exited 0 with an empty results.json."""
    code = _bench(tmp_path, "--target", tiny_llama_pair[0], "--draft", tiny_llama_pair[1], "--batch", "1", flag, ",")
    assert code == 2 and "give at least one" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("axes, named", [(dict(kinds=("bogus",)), "fan_out_kind = 'bogus'"),
                                         (dict(ks=(0,)), "k = 0"), (dict(fallbacks=("nope",)), "fallback = 'nope'")])
def test_a_bad_sweep_value_is_named(axes, named):
    """`--sweep-kinds bogus` said "fan_out = 6: fan_out_kind must be ...": the budget, not the kind."""
    with pytest.raises(ValueError) as err:
        sweep_point_configs(SweepConfig(base=BenchConfig(), **axes))
    assert str(err.value).startswith(f"sweep point {named}: ")


LINES = "".join(f"value_{i} = {i}\n" for i in range(12))  # 8 windows (ends 4-11), every one from line 0


@pytest.mark.timeout(20)
def test_snippets_never_start_on_one_line_twice():
    """Windows were drawn with replacement (23 of the 256 shipped prompts were repeats), and windows that start
    on one line are one prompt once cut to a bench's first tokens."""
    many = "".join(f"v{i} = {i}\n" for i in range(60))
    got = corpus.sample_snippets([many], n=40, max_chars=40, seed=0)
    firsts = [s.splitlines()[0] for s in got]
    assert len(got) == 40 and len(set(firsts)) == 40
    assert corpus.sample_snippets([LINES], n=1, max_chars=1000, seed=0)[0].startswith("value_0 = 0\n")
    with pytest.raises(ValueError, match="2 prompts asked for.*1 windows"):  # (it drew forever)
        corpus.sample_snippets([LINES], n=2, max_chars=1000, seed=0)


def test_the_shipped_prompts_hold_no_repeats():
    prompts = json.loads((PAIR_DIR / "prompts.json").read_text())
    assert len(prompts) == 256 and len(set(prompts)) == 256
