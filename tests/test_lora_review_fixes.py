"""LoRA adapters as vLLM takes them (reviewer finds): a multimodal Gemma 3 checkpoint's adapter (PEFT names its
language model's layers model.language_model.* or language_model.model.*), an adapter saved as adapter_model.bin
(read with torch.load(weights_only=True)), and load_inplace naming a new lora_path under the same lora_int_id
(RL weight sync: each step's folder), which rebinds the id; without load_inplace another path stays refused."""
from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import PROMPTS, assert_greedy_equal, llama_config, save_model
from safetensors.torch import load_file, save_file

from saguaro_dist import LLM, LoRARequest, SamplingParams
from saguaro_dist.model.runner import ModelRunner

peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter, peft_greedy  # noqa: E402 (needs peft)

PROMPT = [5, 17, 3, 44, 9, 28, 61, 2, 13, 7]
N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(24)]


def adapted_logits(model_dir, adapter_dir, prompt=PROMPT) -> torch.Tensor:
    runner = ModelRunner(str(model_dir), max_loras=1, max_lora_rank=8)
    runner.load_lora(0, str(adapter_dir))
    runner.add("s", lora_slot=0)
    return runner.extend(["s"], [prompt], [len(prompt)])[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fixes")
    save_model(root / "target", llama_config(96, 64, 2), seed=0)
    return root


# ---- a multimodal Gemma 3 checkpoint's adapter ------------------------------------------------------
@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_a_multimodal_gemma3_adapter_matches_peft(tmp_path, layout):
    """transformers 4.52+ (and PEFT on it) name the language model model.language_model.*, older ones
    language_model.model.*: vLLM's Gemma3ForConditionalGeneration mapper takes both, and so does the loader."""
    from test_model_gemma3 import save_multimodal
    base = save_multimodal(tmp_path / "mm")
    torch.manual_seed(0)
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      init_lora_weights=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.save_pretrained(tmp_path / "ad")
    file = tmp_path / "ad" / "adapter_model.safetensors"
    tensors = load_file(file)
    assert all(".model.language_model.layers." in k for k in tensors)  # as PEFT writes them today
    save_file({k.replace("model.language_model.", layout): v for k, v in tensors.items()}, file)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits[0].float()
        with model.disable_adapter():
            assert (want - model(input_ids=torch.tensor([PROMPT])).logits[0]).abs().max() > 0.1  # it adapts
    torch.testing.assert_close(adapted_logits(tmp_path / "mm", tmp_path / "ad"), want, atol=2e-5, rtol=0)
    vision = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, vision: torch.zeros(4, 16)}, file)
    with pytest.raises(ValueError, match="vision tower"):
        adapted_logits(tmp_path / "mm", tmp_path / "ad")


# ---- adapter_model.bin -------------------------------------------------------------------------------
class NotATensor:
    pass


def test_an_adapter_saved_as_bin_runs_as_its_safetensors(target, tmp_path):
    model = make_adapter(target / "target", tmp_path / "st", 3, ["q_proj", "v_proj", "down_proj"])
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    want = adapted_logits(target / "target", tmp_path / "st")
    torch.testing.assert_close(adapted_logits(target / "target", tmp_path / "bin"), want, atol=0, rtol=0)
    torch.save({"x": NotATensor()}, tmp_path / "bin" / "adapter_model.bin")  # a pickle of code: never unpickled
    with pytest.raises(ValueError, match="adapter_model.bin cannot be read"):
        adapted_logits(target / "target", tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.bin").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        adapted_logits(target / "target", tmp_path / "bin")


# ---- load_inplace with a new lora_path ----------------------------------------------------------------
def test_load_inplace_rebinds_an_id_to_a_new_path(target, tmp_path):
    """vLLM's RL weight sync: (policy, 1, step_a), then (policy, 1, step_b, load_inplace) runs step_b's weights,
    its prefix rows of step_a gone. vLLM would run a later plain (policy, 1, step_a) on step_b's weights (an id
    runs whatever was loaded last under it): refused here ("one id, one adapter"); load_inplace takes it back."""
    step_a = make_adapter(target / "target", tmp_path / "a", 4, ["q_proj", "v_proj", "down_proj"])
    step_b = make_adapter(target / "target", tmp_path / "b", 5, ["q_proj", "v_proj", "down_proj"])
    prompt = SYSTEM + [5]
    assert peft_greedy(step_a, prompt, N) != peft_greedy(step_b, prompt, N)
    with LLM(model=str(target / "target"), mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        def run(request, reference):
            [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False,
                                 lora_request=request)
            assert_greedy_equal(list(out.outputs[0].token_ids), peft_greedy(reference, prompt, N), prompt, reference)
            return out.metrics.num_cached_tokens
        assert run(LoRARequest("policy", 1, str(tmp_path / "a")), step_a) == 0
        assert run(LoRARequest("policy", 1, str(tmp_path / "a")), step_a) >= len(SYSTEM)  # its prefix kept
        assert run(LoRARequest("policy", 1, str(tmp_path / "b"), load_inplace=True), step_b) == 0
        assert run(LoRARequest("policy", 1, str(tmp_path / "b")), step_b) >= len(SYSTEM)
        with pytest.raises(ValueError, match="one id, one adapter"):
            llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("policy", 1, str(tmp_path / "a")))
        assert run(LoRARequest("policy", 1, str(tmp_path / "a"), load_inplace=True), step_a) == 0


def test_a_batch_naming_a_new_path_with_and_without_load_inplace_runs_both_on_it(target, tmp_path):
    """One generate() with (policy, 1, b, load_inplace) then (policy, 1, b) while the id names a: both run b
    (vLLM's). Old: the batch kept the last request per (id, path) to check, the plain one, while the id still
    named a: the whole call was refused ("one id, one adapter")."""
    step_a = make_adapter(target / "target", tmp_path / "a", 4, ["q_proj", "v_proj", "down_proj"])
    step_b = make_adapter(target / "target", tmp_path / "b", 5, ["q_proj", "v_proj", "down_proj"])
    prompt = SYSTEM + [5]
    want_a, want_b = peft_greedy(step_a, prompt, N), peft_greedy(step_b, prompt, N)
    a, b = (LoRARequest("policy", 1, str(tmp_path / x)) for x in "ab")
    a_inplace, b_inplace = (LoRARequest("policy", 1, str(tmp_path / x), load_inplace=True) for x in "ab")
    with LLM(model=str(target / "target"), mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        def run(requests):
            outs = llm.generate(prompt_token_ids=[prompt] * len(requests), sampling_params=GREEDY, use_tqdm=False,
                                lora_request=requests)
            return [list(o.outputs[0].token_ids) for o in outs]
        assert run([a]) == [want_a]
        assert run([b_inplace, b]) == [want_b, want_b]
        assert run([b]) == [want_b]
        assert run([a_inplace, a, a]) == [want_a] * 3


def test_a_plain_request_sent_just_after_a_load_inplace_one_runs_its_new_path(target, tmp_path):
    """RL weight sync: stream (policy, 1, b, load_inplace) and at once (policy, 1, b), with no await between:
    both run b. Old: the id was rebound only once b's files were read (off the event loop), so the plain request,
    checked meanwhile, was refused. A load_inplace whose adapter cannot be read gives the id back its old path."""
    step_a = make_adapter(target / "target", tmp_path / "a", 4, ["q_proj", "v_proj", "down_proj"])
    step_b = make_adapter(target / "target", tmp_path / "b", 5, ["q_proj", "v_proj", "down_proj"])
    (tmp_path / "broken").mkdir()  # no adapter files
    prompt = SYSTEM + [5]
    want_a, want_b = peft_greedy(step_a, prompt, N), peft_greedy(step_b, prompt, N)
    a = LoRARequest("policy", 1, str(tmp_path / "a"))
    with LLM(model=str(target / "target"), mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        async def tokens(request):
            return [t async for delta in llm.stream(prompt_token_ids=prompt, sampling_params=GREEDY,
                                                    lora_request=request) for t in delta.token_ids]

        async def together(*requests):
            return await asyncio.gather(*(tokens(r) for r in requests), return_exceptions=True)
        assert asyncio.run(together(a)) == [want_a]
        b_inplace = LoRARequest("policy", 1, str(tmp_path / "b"), load_inplace=True)
        assert asyncio.run(together(b_inplace, LoRARequest("policy", 1, str(tmp_path / "b")))) == [want_b, want_b]
        assert asyncio.run(together(LoRARequest("policy", 1, str(tmp_path / "a"), load_inplace=True))) == [want_a]
        broken = LoRARequest("policy", 1, str(tmp_path / "broken"), load_inplace=True)
        failed, refused = asyncio.run(together(broken, LoRARequest("policy", 1, str(tmp_path / "broken"))))
        assert isinstance(failed, ValueError) and "one id, one adapter" not in str(failed), failed
        assert isinstance(refused, ValueError) and "one id, one adapter" in str(refused), refused
        assert asyncio.run(together(a)) == [want_a]  # the id names a again
