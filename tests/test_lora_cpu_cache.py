"""vLLM's max_cpu_loras: adapters once read stay in host memory (an LRU of max_cpu_loras, those in slots among them),
so an adapter evicted from its slot reloads without reading its files again (a load_inplace request reads them
again); outputs stay PEFT's. Refusals at every edge: Config / LLM, `saguaro serve`, K8sSettings / `saguaro deploy
k8s`. Real tiny checkpoints and PEFT adapters (test_lora_engine's); the reads are counted at the engine's one
reader, model/lora_adapter.load_adapter, which still reads every file."""
from __future__ import annotations

import shlex
from collections import Counter

import pytest
from engine_helpers import PROMPTS
from test_lora_engine import GREEDY, check, pair  # noqa: F401 - pair: the module's fixture (base, adapters, PEFT)

from saguaro_dist import LLM, LoRARequest
from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.config import Config
from saguaro_dist.deploy import k8s
from saguaro_dist.engine import lora_slots
from saguaro_dist.serve.args import config_from_args


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """lora_path -> times the engine read that adapter's files (the real reader runs each time)."""
    counts, real = Counter(), lora_slots.load_adapter

    def counted(path, *args, **kw):
        counts[path] += 1
        return real(path, *args, **kw)
    monkeypatch.setattr(lora_slots, "load_adapter", counted)
    return counts


def run_each(llm: LLM, loras: list) -> list[list[int]]:
    """One generate per request, in turn: with one slot, each evicts the adapter before it."""
    return [llm.generate(prompt_token_ids=[PROMPTS[i % 2]], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=lora)[0].outputs[0].token_ids for i, lora in enumerate(loras)]


def one_slot_llm(pair, **kw) -> LLM:  # noqa: F811
    return LLM(model=pair["target"], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=16, **kw)


def test_alternating_adapters_read_each_once_and_match_peft(pair, reads):  # noqa: F811
    """max_loras 1, max_cpu_loras 2: one, two, one, two swap the one slot each time; each adapter's files are read
    once, and every output is PEFT's generate with its adapter."""
    one, two = pair["requests"]
    loras = [one, two, one, two]
    with one_slot_llm(pair, max_cpu_loras=2) as llm:
        outs = run_each(llm, loras)
    assert reads == {one.lora_path: 1, two.lora_path: 1}
    for i, (lora, out) in enumerate(zip(loras, outs)):
        check(pair, lora, PROMPTS[i % 2], out)


def test_host_copies_are_bounded_least_recently_used_first(pair, reads):  # noqa: F811
    """max_cpu_loras 2 of three adapters: a third evicts the least recently used copy, which is read again; the
    default (max_cpu_loras = max_loras = 1) keeps only the adapter in the slot."""
    one, two = pair["requests"]
    wide = LoRARequest("wide", 3, pair["wide"])
    with one_slot_llm(pair, max_cpu_loras=2) as llm:
        outs = run_each(llm, [one, two, wide, two, one])
    assert reads == {one.lora_path: 2, two.lora_path: 1, wide.lora_path: 1}
    check(pair, one, PROMPTS[0], outs[4])
    reads.clear()
    with one_slot_llm(pair) as llm:
        assert llm.config.max_cpu_loras is None  # vLLM's default: max_loras
        run_each(llm, [one, two, one])
    assert reads == {one.lora_path: 2, two.lora_path: 1}


def test_a_load_inplace_request_reads_the_files_again(pair, reads):  # noqa: F811
    """A copy in host memory does not stand in for a load_inplace request: its adapter is read again."""
    one, two = pair["requests"]
    again = LoRARequest(one.lora_name, one.lora_int_id, one.lora_path, load_inplace=True)
    with one_slot_llm(pair, max_cpu_loras=2) as llm:
        outs = run_each(llm, [one, two, again])
    assert reads == {one.lora_path: 2, two.lora_path: 1}
    check(pair, one, PROMPTS[0], outs[2])


@pytest.mark.parametrize("kw, message", [
    (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras must be an integer >= max_loras \(2\)"),
    (dict(max_cpu_loras=0), "max_cpu_loras must be"),
    (dict(max_cpu_loras="4"), "max_cpu_loras must be"),
    (dict(max_cpu_loras=2.0), "max_cpu_loras must be"),
])
def test_refused_max_cpu_loras(kw, message):
    with pytest.raises(ValueError, match=message):
        Config(model="unused", mode="ar", enable_lora=True, **kw)
    if not isinstance(kw["max_cpu_loras"], str):  # (app args take "4" for 4, as every int field's)
        with pytest.raises(ValueError, match=message):
            k8s.K8sSettings(enable_lora=True, **kw)


def test_serve_refuses_fewer_cpu_loras_than_loras_before_ray(pair, capsys):  # noqa: F811
    assert main(["serve", pair["target"], "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"]) == 2
    assert "max_cpu_loras must be an integer >= max_loras (2)" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["rayservice", "serve-config"])
def test_deploy_flag_reaches_the_engine(kind):
    argv = f"--kind {kind} --enable-lora --max-loras 2 --max-cpu-loras 3"
    (doc,) = manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))
    from test_deploy_lora import app_args
    config = config_from_args(app_args(doc))
    assert (config.max_loras, config.max_cpu_loras) == (2, 3)
    assert "max_cpu_loras" not in app_args(k8s.rayservice(k8s.K8sSettings(enable_lora=True)))
    assert k8s.helm_values(k8s.K8sSettings(enable_lora=True, max_cpu_loras=4))["lora"]["maxCpuLoras"] == 4


def test_host_copies_never_drop_an_adapter_a_slot_holds():
    """A hot adapter that stays in its slot became the least recently used host copy and was dropped first
    (the runner kept its tensors anyway: max_cpu_loras + max_loras copies lived, and its files were read again
    when it left its slot). Held ids are never dropped, and a slot hit counts as a use."""
    host = lora_slots.HostAdapters(2)
    host.put(1, "hot", {1})
    host.put(2, "x", {1, 2})
    host.put(3, "y", {1, 3})  # 1 is the oldest but held: 2 goes
    assert host.get(1) == "hot" and host.get(2) is None and host.get(3) == "y"
    host.put(4, "z", {4})     # nothing held but 4: the least recently used of the rest goes (1, touched before 3)
    assert host.get(1) is None and host.get(3) == "y" and host.get(4) == "z"
