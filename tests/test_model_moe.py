"""Mixture-of-experts targets: Mixtral (model_type "mixtral"), Qwen3-MoE ("qwen3_moe"), Qwen2-MoE ("qwen2_moe": a
shared expert) and OLMoE ("olmoe": q / k norms over whole projections, clip_qkv). Logits as transformers
5.25 computes them on tiny seeded checkpoints (routers sharpened, so a wrong top-k, softmax or renormalisation
moves them) on every attention path, both weight layouts a user meets (the Hub's per-expert tensors, which
save_pretrained writes, and transformers' stacked ones), Qwen3-MoE's dense layers (mlp_only_layers,
decoder_sparse_step), 2 tensor-parallel ranks equal to 1, greedy ar / sd / ssd equal to transformers' generate
with a dense Qwen3 draft, and the configs this runtime cannot compute refused by name."""
from __future__ import annotations

import pytest
import torch
from model_checks import (check_batched_extends, check_greedy_generation, check_logits, check_static_steps,
                          check_two_branches, hf_logits, random_tokens,
                          randomise)
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from saguaro_dist.model.hf_config import parse_config
from saguaro_dist.model.runner import ModelRunner

VOCAB, WINDOW, ATOL = 64, 6, 1e-5
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
          "tie_word_embeddings": False, "num_experts_per_tok": 2}
# Mixtral with a sliding window (every layer); Qwen3-MoE with a dense layer (mlp_only_layers), renormalised or
# not, and every other layer sparse (decoder_sparse_step 2); Qwen2-MoE with its shared expert, a dense layer and
# sliding layers (its rule: even layers below max_window_layers); OLMoE with clip_qkv (near the q / k / v scale)
FAMILIES = {
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=40, num_hidden_layers=2, num_local_experts=4,
                                     sliding_window=WINDOW),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                        num_hidden_layers=3, num_experts=4, mlp_only_layers=[1],
                                        norm_topk_prob=True),
    "qwen3_moe_step2": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                              num_hidden_layers=4, num_experts=5, decoder_sparse_step=2,
                                              norm_topk_prob=False),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=40, num_hidden_layers=4, num_experts=4,
                                        mlp_only_layers=[1], norm_topk_prob=True, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=3),
    "olmoe": lambda: OlmoeConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_experts=4, clip_qkv=1.5),
}
MODEL_CLASSES = {"mixtral": MixtralForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM,
                 "olmoe": OlmoeForCausalLM}
ROUTER_GAIN = 6.0  # HF's router init routes near uniformly: a wrong weighting of the experts would hardly show


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def save_moe(path, family: str, seed: int = 0, sharpen: float = 1.0, **save_kw):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    model = MODEL_CLASSES[config.model_type](config).eval()
    randomise(model, sharpen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers (transformers 5's names in memory)
                p.copy_(ROUTER_GAIN * torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path, **save_kw)
    return model


def tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n, VOCAB)


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    torch.set_num_threads(1)
    return {"family": request.param, "path": path, "model": save_moe(path, request.param, seed=3)}


# ---- logits on every attention path ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [2048, 5])
def test_logits_match_transformers_in_prefill_and_decode(moe, chunk):
    """Half the prompt prefilled (whole, or in chunks of 5), the rest decoded; 24 tokens, past Mixtral's window."""
    check_logits(moe["path"], moe["model"], tokens(2, 24), max_num_batched_tokens=chunk)


def test_batched_extend_of_mixed_lengths_matches_transformers(moe):
    check_batched_extends(moe["path"], moe["model"], [tokens(7, 15), tokens(8, 9)], [[8], [2]])


def test_branch_steps_match_transformers(moe):
    check_two_branches(moe["path"], moe["model"], tokens(9, 7))


def test_the_static_steps_give_the_eager_logits(moe):
    """The static (CUDA-graph) layouts, run uncaptured: padding rows route to experts too, harmlessly."""
    check_static_steps(moe["path"])


def test_transformers_stacked_expert_layout_loads_too(moe, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers 5's in-memory names: experts stacked in
    3-D gate_up_proj / down_proj, Mixtral's block_sparse_moe as mlp. (The fixture's own model, saved again in
    that layout: rebuilding it from the seed gave the same weights at the cost of a second random init.)"""
    moe["model"].save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())
    check_logits(tmp_path, moe["model"], tokens(4, 16))


def test_the_sparse_layers_are_the_ones_transformers_builds(moe):
    cfg = parse_config(moe["model"].config.to_dict())
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in moe["model"].model.layers]
    assert list(cfg.sparse_layers) == sparse and any(sparse)
    assert moe["family"] in ("mixtral", "olmoe") or not all(sparse)


# ---- tensor parallel -----------------------------------------------------------------------------
TP_FAMILIES = ("mixtral", "qwen3_moe_step2", "qwen2_moe", "olmoe")
TP_REFUSALS = {"odd_expert": "tensor parallel size 2 must divide moe_intermediate_size=25",
               "odd_shared_expert": "tensor parallel size 2 must divide shared_expert_intermediate_size=25"}


def _rank(rank: int, init_method: str, paths: list[str], refused: list[str], result_file: str) -> None:
    """One of 2 ranks: test_model_tp's workload on each of paths, then the ValueError of each refused checkpoint."""
    from test_model_tp import gloo_world, workload
    torch.set_num_threads(1)
    with gloo_world(rank, 2, init_method) as group:
        results = [workload(ModelRunner(p, tp_group=group)) for p in paths]
        for path in refused:
            try:
                ModelRunner(path, tp_group=group)
                results.append("no error")
            except ValueError as e:
                results.append(str(e))
        torch.save(results, f"{result_file}.{rank}")


def save_tp_refusals(root) -> list[str]:
    """Checkpoints 2 ranks cannot split: an odd expert width (Qwen3-MoE), an odd shared expert width (Qwen2-MoE)."""
    torch.manual_seed(0)
    configs = {"odd_expert": Qwen3MoeConfig(**{**COMMON, "intermediate_size": 48, "moe_intermediate_size": 25,
                                                "num_hidden_layers": 1, "num_experts": 4}),
               "odd_shared_expert": Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                                   num_hidden_layers=1, num_experts=4,
                                                   shared_expert_intermediate_size=25)}
    classes = {"odd_expert": Qwen3MoeForCausalLM, "odd_shared_expert": Qwen2MoeForCausalLM}
    for name, config in configs.items():
        classes[name](config).save_pretrained(root / name)
    return [str(root / name) for name in TP_REFUSALS]


@pytest.mark.slow
def test_tensor_parallel_two_ranks_equal_one(tmp_path):
    """Each expert's width split over 2 ranks, the router replicated, one all-reduce a block (Qwen2-MoE's shared
    expert split by width as an expert, its gate replicated; OLMoE's projection norms summed over the ranks'
    heads): the logits of 1 rank, on extend and branch decode, and 1 rank's transformers' on the same weights;
    an odd expert or shared expert width is refused, naming it. (One spawn for all of it: each spawn starts two
    interpreters importing torch and transformers; these checks had four.)"""
    import torch.multiprocessing as mp
    from test_model_tp import rendezvous, workload
    paths = [str(tmp_path / f) for f in TP_FAMILIES]
    models = [save_moe(path, family, seed=6) for path, family in zip(paths, TP_FAMILIES)]
    mp.spawn(_rank, args=(rendezvous(), paths, save_tp_refusals(tmp_path), str(tmp_path / "out")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{rank}") for rank in (0, 1)]
    for results in ranks:
        for message, want in zip(results[len(paths):], TP_REFUSALS.values()):
            assert want in message, message
    for path, model, got0, got1 in zip(paths, models, ranks[0], ranks[1]):
        check_logits(path, model, tokens(3, 12))
        for a, b, want in zip(got0, got1, workload(ModelRunner(path))):
            torch.testing.assert_close(a, want, atol=ATOL, rtol=0)
            torch.testing.assert_close(b, a, atol=0, rtol=0)


# ---- greedy generation: an MoE target, a dense Qwen3 draft of the same vocabulary ---------------------
@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def moe_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}_pair")
    torch.set_num_threads(1)
    model = save_moe(root / "target", request.param, seed=0, sharpen=4.0)
    torch.manual_seed(1)
    draft = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in COMMON.items() if k != "num_experts_per_tok"},
                                         intermediate_size=48, num_hidden_layers=1, head_dim=8))
    draft.save_pretrained(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_generation_matches_transformers_generate(moe_pair, mode):
    check_greedy_generation(moe_pair, mode, tokens(5, 12), 20)


# ---- config.json as transformers reads it, and refusals -------------------------------------------
def qwen3_moe_json(**changes) -> dict:
    return {**FAMILIES["qwen3_moe"]().to_dict(), **changes}


def test_a_hub_qwen3_moe_config_reads_as_transformers_reads_it():
    """Qwen3-30B-A3B's config.json says num_experts (transformers 5 writes num_local_experts); the window only
    with use_sliding_window, then on every layer; Mixtral's absent sliding_window is null (MixtralConfig's)."""
    hf = {k: v for k, v in qwen3_moe_json(num_experts=128, num_experts_per_tok=8).items() if k != "num_local_experts"}
    want = Qwen3MoeConfig.from_dict(hf)
    cfg = parse_config(hf)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (want.num_experts, 8, 24)
    assert cfg.qk_norm and cfg.renormalise_topk and not cfg.routing_weights_fp32 and cfg.layer_windows == ()
    assert parse_config({**hf, "use_sliding_window": True, "sliding_window": 5}).layer_windows == (5,) * 3
    mixtral = {k: v for k, v in FAMILIES["mixtral"]().to_dict().items() if k != "sliding_window"}
    cfg = parse_config(mixtral)
    assert cfg.layer_windows == () and cfg.renormalise_topk and cfg.routing_weights_fp32 and not cfg.qkv_bias
    assert cfg.moe_intermediate_size == 40 and cfg.sparse_layers == (True, True)


@pytest.mark.parametrize("changes, message", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64: a shared expert is not supported"),
    ({"n_shared_experts": 2}, "n_shared_experts 2: a shared expert is not supported"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer >= 1, got 0"),
    ({"num_local_experts": 0}, "num_experts must be an integer >= 1, got 0"),
    ({"num_experts": 8}, "num_local_experts 4 and num_experts 8"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1, got 0"),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers must list layer indices in 0..2, got \[3\]"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be an integer >= 1, got None"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_what_this_runtime_cannot_compute_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        parse_config(qwen3_moe_json(**changes))


def test_an_unsupported_moe_family_is_refused_by_name():
    with pytest.raises(ValueError, match="unsupported architecture .*model_type 'deepseek_v2'.*mixtral, qwen3_moe"):
        parse_config(qwen3_moe_json(model_type="deepseek_v2"))


def test_transformers_reads_the_test_checkpoints_as_written(moe):
    """The reference itself: transformers reloads the saved Hub layout to the same logits (nothing dropped)."""
    seq = tokens(1, 8)
    reloaded = AutoModelForCausalLM.from_pretrained(moe["path"], dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(reloaded, seq), hf_logits(moe["model"], seq), atol=0, rtol=0)
    assert any(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in reloaded.model.layers)
