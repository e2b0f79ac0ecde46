"""Multi-LoRA through the engine (vLLM's enable_lora / LoRARequest): greedy outputs as PEFT's generate on the
adapted model in every mode, batches mixing adapters and the base model, max_loras making requests wait, the
prefix cache never sharing KV across adapters (nor after a slot was reloaded), every refusal, the Ray path, and
sampling's distribution under an adapter."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy

from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.beam_search import BeamSearchParams
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.sequence import Sequence, SeqStatus

peft = pytest.importorskip("peft")
N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(40)]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path, out, seed: int, targets, r: int = 4, alpha: int = 8, scale: float = 20.0):
    """A PEFT adapter with non-zero B, saved to `out`; the PEFT model, for references."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                      init_lora_weights=False)).eval()
    with torch.no_grad():  # PEFT's non-zero init is small: larger, so that the adapter changes the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return model


def peft_greedy(model, prompt: list[int], n: int = N) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_pair")
    pair = close_pair(root)
    one = make_adapter(pair["target"], root / "one", 1, ["q_proj", "v_proj", "down_proj"])
    two = make_adapter(pair["target"], root / "two", 2, ALL, r=8, alpha=16)
    make_adapter(pair["target"], root / "wide", 3, ["q_proj"], r=16, alpha=16)
    pair["requests"] = [LoRARequest("one", 1, str(root / "one")), LoRARequest("two", 2, str(root / "two"))]
    pair["peft"] = [one, two]
    pair["wide"] = str(root / "wide")
    return pair


def want(pair, lora: LoRARequest | None, prompt: list[int], n: int = N) -> list[int]:
    if lora is None:
        return hf_greedy(pair["model"], prompt, n)
    return peft_greedy(pair["peft"][lora.lora_int_id - 1], prompt, n)


def check(pair, lora, prompt, got) -> None:
    reference = pair["model"] if lora is None else pair["peft"][lora.lora_int_id - 1]
    assert_greedy_equal(list(got), want(pair, lora, prompt, len(got)), prompt, reference)


def lora_llm(pair, mode="ar", **kw) -> LLM:
    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=8, mode=mode) | kw
    if mode != "ar":
        settings |= dict(draft=pair["close"], k=3)
    return LLM(model=pair["target"], **settings)


def test_the_adapters_change_the_output(pair):
    """Else the tests below could not tell an adapter from the base model."""
    one, two = pair["requests"]
    for prompt in PROMPTS[:2]:
        assert len({tuple(want(pair, r, prompt)) for r in (None, one, two)}) == 3


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_batch_of_two_adapters_and_the_base_matches_peft(pair, mode):
    """Each row as PEFT's generate with its adapter (the base model's as transformers'), in one batch; in sd / ssd
    the draft drafts for the base model and the target verifies through the adapter."""
    one, two = pair["requests"]
    loras = [one, two, None, two]
    with lora_llm(pair, mode) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False, lora_request=loras)
        alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False, lora_request=one)
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        check(pair, lora, prompt, out.outputs[0].token_ids)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_stream_and_beam_search_take_a_lora_request(pair):
    one, _ = pair["requests"]
    with lora_llm(pair) as llm:
        async def streamed():
            return [t async for d in llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY, lora_request=one)
                    for t in d.token_ids]
        assert asyncio.run(streamed()) == want(pair, one, PROMPTS[0])
        beams = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=1, max_tokens=4),
                                lora_request=one)
    assert beams[0].sequences[0].tokens == PROMPTS[0] + want(pair, one, PROMPTS[0], 4)


def test_max_loras_one_makes_the_other_adapter_wait(pair):
    """Two adapters' requests at once, one slot: the second adapter's waits (not failed) until the first's are
    done, then both complete, exact; a base-model request behind it is not held up."""
    one, two = pair["requests"]
    config = Config(model=pair["target"], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, _ = build_local_engine(config)
    loras = [one, two, None]
    seqs = [Sequence(i, f"r{i}", list(PROMPTS[i]), GREEDY, lora_request=lora) for i, lora in enumerate(loras)]
    try:
        for s in seqs:
            engine.add(s)
        engine.step()
        assert [s.status for s in seqs] == [SeqStatus.RUNNING, SeqStatus.WAITING, SeqStatus.RUNNING]
        assert list(engine.waiting) == [seqs[1]]
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    for s, lora in zip(seqs, loras):
        assert s.error is None
        check(pair, lora, s.prompt_token_ids, s.output_token_ids)


def test_prefix_reuse_stays_within_an_adapter(pair):
    """A shared system prompt is reused by a later request of the same adapter, never by another adapter's
    nor the base model's (nor the base's by an adapter's); outputs stay exact."""
    one, two = pair["requests"]
    prompt = SYSTEM + [5, 6]
    with lora_llm(pair) as llm:
        def run(lora):
            [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False, lora_request=lora)
            check(pair, lora, prompt, out.outputs[0].token_ids)
            return out.metrics.num_cached_tokens
        cached = [run(lora) for lora in (None, one, two, one, two)]  # (the CPU pool keeps 4 rows: LRU)
        llm.reset_prefix_cache()
        cached += [run(lora) for lora in (one, None)]
    assert cached[:3] == [0, 0, 0] and cached[5:] == [0, 0], cached
    assert all(c >= len(SYSTEM) for c in cached[3:5]), cached


def test_an_evicted_and_reloaded_adapter_reuses_no_stale_prefix(pair):
    """max_loras 1: adapter one leaves a kept prefix, two evicts one, one is loaded again: its request sharing
    that prefix is exact and does not crash (the kept rows of the old load were dropped with the slot)."""
    one, two = pair["requests"]
    with lora_llm(pair, max_loras=1) as llm:
        def run(lora, prompt):
            [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False, lora_request=lora)
            check(pair, lora, prompt, out.outputs[0].token_ids)
            return out.metrics.num_cached_tokens
        assert run(one, SYSTEM + [5]) == 0
        assert run(one, SYSTEM + [6]) >= len(SYSTEM)  # reused while its slot holds it
        assert run(two, SYSTEM + [7]) == 0
        assert run(one, SYSTEM + [8]) == 0
        assert run(one, SYSTEM + [9]) >= len(SYSTEM)
        reloaded = LoRARequest("one", 1, one.lora_path, load_inplace=True)
        assert run(reloaded, SYSTEM + [10]) == 0  # loaded again: the old load's rows go


def test_refusals(pair):
    one, two = pair["requests"]
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("x", 1, "")
    with pytest.raises(ValueError, match="tensorizer"):
        LoRARequest("x", 1, "/tmp", tensorizer_config_dict={})
    for kw, match in ((dict(max_loras=0), "max_loras"), (dict(max_lora_rank=4), "max_lora_rank"),
                      (dict(enable_lora="yes"), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            Config(model=pair["target"], mode="ar", **kw)
    with LLM(model=pair["target"], mode="ar") as plain:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False, lora_request=one)
    with lora_llm(pair) as llm:
        def generate(loras):
            return llm.generate(prompt_token_ids=PROMPTS[:len(loras)], sampling_params=GREEDY, use_tqdm=False,
                                lora_request=loras)
        for loras, match in (([one, LoRARequest("bad", 3, str(pair["wide"]) + "-missing")], "not a directory"),
                             ([None, LoRARequest("wide", 4, pair["wide"])], "greater than max_lora_rank 8"),
                             ([one, LoRARequest("again", 1, two.lora_path)], "lora_int_id 1 names adapter"),
                             ([one], "1 lora_request for 2 prompts"), ("one", "must be a LoRARequest")):
            with pytest.raises(ValueError, match=match):
                llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False, lora_request=loras)
        assert llm.metrics.generated_tokens == 0  # each refused before any work
        [out] = generate([LoRARequest("bad", 3, two.lora_path)])  # a refused id stays free for its right path
        check(pair, two, PROMPTS[0], out.outputs[0].token_ids)


def test_an_adapter_that_fails_to_load_fails_its_request_alone(pair, tmp_path):
    """Checked at the edge, then gone before the engine loads it: that request fails, the batch goes on."""
    import shutil
    one, _ = pair["requests"]
    doomed = tmp_path / "doomed"
    shutil.copytree(one.lora_path, doomed)
    with lora_llm(pair) as llm:
        llm._check_adapter(LoRARequest("doomed", 9, str(doomed)))  # what the edge does
        llm._lora_ids.bind(LoRARequest("doomed", 9, str(doomed)))
        (doomed / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_dora": True,
                                                                 "target_modules": ["q_proj"]}))
        with pytest.raises(ValueError, match="DoRA"):
            llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=[LoRARequest("doomed", 9, str(doomed)), None])
        [ok] = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY, use_tqdm=False)
    check(pair, None, PROMPTS[1], ok.outputs[0].token_ids)


@pytest.mark.slow
def test_the_ray_path_runs_an_adapter(ray_cluster, pair):
    """On Ray (tensor parallel 2: every rank loads the adapter into the same slot), rows as PEFT's and the base's."""
    one, two = pair["requests"]
    loras = [one, None, two]
    with LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, cluster="auto", tensor_parallel_size=2,
             enable_lora=True, max_loras=2, max_lora_rank=8, max_batch_size=4) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=GREEDY, use_tqdm=False, lora_request=loras)
        # a request's adapter is read where the target loads it (rank 0's node), not on the driver's disk
        with pytest.raises(ValueError, match="read on the node of the target's rank 0"):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("gone", 7, str(pair["wide"]) + "-gone"))
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        check(pair, lora, prompt, out.outputs[0].token_ids)


@pytest.mark.slow
def test_ssd_sampling_with_an_adapter_follows_the_adapted_target(tmp_path):
    """A chi-square over the 3-token joint: SSD (the draft drafting for the base model) samples the adapted
    target's distribution."""
    from test_engine_sampling import ALPHA, PROMPT, chi_square_pvalue, exact_joint, sampling_pair
    target, draft, _ = sampling_pair(tmp_path)
    model = make_adapter(target, tmp_path / "a", 5, ALL, r=4, alpha=8, scale=5.0)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    n, params = 6000, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    with LLM(model=target, draft=draft, mode="ssd", k=1, fan_out=3, fallback="neural", tree_policy="always",
             draft_executor="thread", max_batch_size=64, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=[SamplingParams(
            temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)], use_tqdm=False,
            lora_request=lora)
        assert llm.metrics.cache_hits > 0
    counts: dict = {}
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] = counts.get(tuple(o.outputs[0].token_ids), 0) + 1
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize("corrupt", ["safetensors", "config_list"])
def test_a_corrupt_adapter_at_load_fails_its_request_alone_and_frees_its_id(pair, tmp_path, corrupt):
    """Files that are no adapter at the engine's load (a safetensors header that does not parse, a config that
    is no JSON object) failed the whole engine step, every request in flight with it. Now that request fails
    alone (a ValueError), the base request beside it runs, and the id it never loaded can name a good path."""
    import shutil
    one, _ = pair["requests"]
    doomed = tmp_path / "doomed"
    shutil.copytree(one.lora_path, doomed)
    bad = LoRARequest("doomed", 9, str(doomed))
    with lora_llm(pair) as llm:
        llm._check_adapter(bad)  # what the edge does, before the files change under it
        llm._lora_ids.bind(bad)
        if corrupt == "safetensors":
            (doomed / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
        else:
            (doomed / "adapter_config.json").write_text("[]")
        with pytest.raises(ValueError, match="doomed"):
            llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False, lora_request=[bad, None])
        [ok] = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY, use_tqdm=False)
        check(pair, None, PROMPTS[1], ok.outputs[0].token_ids)


def test_an_engine_whose_adapter_never_loaded_lets_its_id_name_a_good_path(pair, tmp_path):
    """A failed load leaves the engine's lora_int_id unbound: the id may then name a good adapter (the base
    request in the same step is not held up)."""
    one, _ = pair["requests"]
    config = Config(model=pair["target"], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, _ = build_local_engine(config)
    missing, good = LoRARequest("x", 9, str(tmp_path / "gone")), LoRARequest("x", 9, one.lora_path)
    seqs = [Sequence(0, "bad", list(PROMPTS[0]), GREEDY, lora_request=missing),
            Sequence(1, "base", list(PROMPTS[1]), GREEDY)]
    try:
        for s in seqs:
            engine.add(s)
        engine.step()
        assert isinstance(seqs[0].error, ValueError) and seqs[1].error is None
        later = Sequence(2, "good", list(PROMPTS[2]), GREEDY, lora_request=good)
        engine.add(later)
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    check(pair, None, PROMPTS[1], seqs[1].output_token_ids)
    assert later.error is None
    check(pair, one, PROMPTS[2], later.output_token_ids)  # (adapter "one"'s weights, under id 9)


def test_stream_reads_a_new_adapter_off_the_event_loop(pair):
    """An adapter's first read (on Ray a round trip to rank 0, maybe a Hub fetch) blocked the replica's event
    loop, every other request on it waiting; LLM.stream now reads it on a worker thread."""
    import threading
    one, _ = pair["requests"]
    with lora_llm(pair) as llm:
        readers, read = [], llm._check_adapter

        def recording(request):
            readers.append(threading.current_thread())
            return read(request)
        llm._check_adapter = recording

        async def run():
            tokens = [t async for delta in llm.stream(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY,
                                                      lora_request=one) for t in delta.token_ids]
            return threading.current_thread(), tokens
        loop_thread, tokens = asyncio.run(run())
    assert readers and all(t is not loop_thread for t in readers)
    check(pair, one, PROMPTS[0], tokens)
