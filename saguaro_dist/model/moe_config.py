"""The mixture-of-experts families' config.json fields, read as transformers 5.25's config classes read them:
Mixtral ("mixtral"), Qwen3-MoE ("qwen3_moe"), Qwen2-MoE ("qwen2_moe": Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B, a
sigmoid-gated shared expert beside the routed ones) and OLMoE ("olmoe": OLMoE-1B-7B, q / k norms over whole
projections, q / k / v clipped at clip_qkv). gpt-oss's experts are its own (gpt_oss_config.py)."""
from __future__ import annotations

from saguaro_dist.model.rope_checks import is_number

QWEN2_MOE_TYPE, OLMOE_TYPE = "qwen2_moe", "olmoe"
MOE_TYPES = ("mixtral", "qwen3_moe", QWEN2_MOE_TYPE, OLMOE_TYPE)
# The config classes' defaults for the expert fields a config.json omits (OLMoE's experts are intermediate_size wide)
_MOE_DEFAULTS = {"mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
                 "qwen3_moe": {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
                 QWEN2_MOE_TYPE: {"num_local_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408},
                 OLMOE_TYPE: {"num_local_experts": 64, "num_experts_per_tok": 8}}
# Qwen2MoeConfig's / OlmoeConfig's defaults for the other fields this runtime reads (what a Hub file may omit)
_VIEW_DEFAULTS = {QWEN2_MOE_TYPE: {"qkv_bias": True, "rms_norm_eps": 1e-6, "shared_expert_intermediate_size": 5632,
                                   "use_sliding_window": False, "max_window_layers": 28,
                                   "num_key_value_heads": 16},  # Qwen2MoeConfig's, not the head count
                  OLMOE_TYPE: {"rms_norm_eps": 1e-5, "attention_bias": False, "clip_qkv": None}}
# A shared expert is Qwen2-MoE's alone (one, sigmoid-gated); DeepSeek's several are refused in every family
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def moe_view(hf: dict) -> dict:
    """Qwen2-MoE's / OLMoE's config.json with the config class's defaults filled in; Qwen2-MoE's layer_types,
    when absent, as Qwen2MoeConfig.__post_init__ makes them: layer i slides when use_sliding_window, i is even
    ((i + 1) % 2) and i < max_window_layers. Any other family's as it is."""
    defaults = _VIEW_DEFAULTS.get(hf.get("model_type"))
    if defaults is None:
        return hf
    view = {**defaults, **hf}
    if view["model_type"] == QWEN2_MOE_TYPE and hf.get("layer_types") is None and "num_hidden_layers" in hf:
        slides = bool(view["use_sliding_window"])
        view["layer_types"] = ["sliding_attention" if slides and (i + 1) % 2 and i < view["max_window_layers"]
                               else "full_attention" for i in range(hf["num_hidden_layers"])]
    return view


def _positive_int(hf: dict, key: str, value) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"config.json (model_type {hf['model_type']!r}) {key} must be an integer >= 1, got {value!r}")
    return value


def _expert_count(hf: dict) -> int:
    """num_local_experts (Mixtral's, and what transformers 5 writes for Qwen3-MoE) or num_experts (the Qwen Hub
    files' and OLMoE's); the configs alias one to the other, so two different values are refused."""
    given = {k: hf[k] for k in ("num_local_experts", "num_experts") if hf.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"config.json gives num_local_experts {given['num_local_experts']!r} and num_experts "
                         f"{given['num_experts']!r}: one name for one count, they must agree")
    count = next(iter(given.values()), _MOE_DEFAULTS[hf["model_type"]]["num_local_experts"])
    return _positive_int(hf, "num_experts", count)


def _sparse_layers(hf: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers route to experts: Mixtral's and OLMoE's all; Qwen3-MoE's and Qwen2-MoE's those not in
    mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step (their DecoderLayer's rule)."""
    if hf["model_type"] in ("mixtral", OLMOE_TYPE):
        return (True,) * num_layers
    step = _positive_int(hf, "decoder_sparse_step", hf.get("decoder_sparse_step", 1))
    dense = hf.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) and 0 <= i < num_layers for i in dense)):
        raise ValueError(f"config.json mlp_only_layers must list layer indices in 0..{num_layers - 1}, got {dense!r}")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _shared_expert(hf: dict) -> int:
    """Qwen2-MoE's shared expert width (0: none, every other family); a shared expert elsewhere is refused."""
    model_type = hf["model_type"]
    keys = _SHARED_EXPERT_KEYS if model_type != QWEN2_MOE_TYPE else _SHARED_EXPERT_KEYS[1:]
    shared = [k for k in keys if hf.get(k)]
    if shared:
        raise ValueError(f"config.json {shared[0]} {hf[shared[0]]!r}: a shared expert is not supported "
                         f"(model_type {model_type!r} routes to its experts only)")
    if model_type != QWEN2_MOE_TYPE:
        return 0
    return _positive_int(hf, "shared_expert_intermediate_size", hf["shared_expert_intermediate_size"])


def _olmoe_fields(hf: dict) -> dict:
    """OLMoE's q / k norms span q_proj's hidden_size and k_proj's (hidden_size / heads) x kv heads outputs
    (OlmoeAttention), so a head_dim of another width is refused; clip_qkv: null, or a number > 0."""
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hf.get("hidden_size"):
        raise ValueError(f"config.json (model_type 'olmoe') head_dim {head_dim} x num_attention_heads {heads} must "
                         f"be hidden_size {hf.get('hidden_size')} (OLMoE's q / k norms span hidden_size)")
    clip = hf.get("clip_qkv")
    if clip is not None and not (is_number(clip) and 0 < clip < float("inf")):
        raise ValueError(f"config.json (model_type 'olmoe') clip_qkv must be null or a finite number > 0, got {clip!r}")
    return {"projection_qk_norms": True, "qkv_clip": None if clip is None else float(clip)}


def moe_fields(hf: dict) -> dict:
    """The expert fields: the router's top-k over num_experts (softmax in fp32), renormalised (Mixtral always,
    the others per norm_topk_prob), each expert a SwiGLU of its own width; Qwen2-MoE's shared expert, OLMoE's
    attention. Router jitter and aux-loss fields are training-only (ignored, as transformers' eval forward does)."""
    model_type = hf["model_type"]
    shared = _shared_expert(hf)
    experts = _expert_count(hf)
    top_k = _positive_int(hf, "num_experts_per_tok", hf.get("num_experts_per_tok",
                                                             _MOE_DEFAULTS[model_type]["num_experts_per_tok"]))
    if top_k > experts:
        raise ValueError(f"config.json num_experts_per_tok {top_k} is more than the {experts} experts")
    key = "intermediate_size" if model_type in ("mixtral", OLMOE_TYPE) else "moe_intermediate_size"
    width = hf.get(key, _MOE_DEFAULTS[model_type].get(key))
    num_layers = hf.get("num_hidden_layers")
    if num_layers is None:
        raise ValueError("config.json lacks the field 'num_hidden_layers'")
    fields = {"num_experts": experts, "experts_per_token": top_k,
              "moe_intermediate_size": _positive_int(hf, key, width),
              "renormalise_topk": model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
              "routing_weights_fp32": model_type == "mixtral",
              "sparse_layers": _sparse_layers(hf, num_layers), "shared_expert_intermediate_size": shared}
    return {**fields, **(_olmoe_fields(hf) if model_type == OLMOE_TYPE else {})}
