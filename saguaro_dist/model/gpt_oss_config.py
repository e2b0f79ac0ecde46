"""OpenAI gpt-oss's config.json (model_type "gpt_oss": gpt-oss-20b, gpt-oss-120b) read as transformers 5.25's
GptOssConfig reads it: attention sinks (a learned logit per head in each softmax's denominator:
attention.sink_attention), layers alternating sliding (sliding_window) and full attention, yarn rope, q / k / v /
o biases, and every layer a mixture of experts (moe.GptOssMoeBlock: a biased router, top-k then a softmax over
the chosen, experts with biases and a clamped SwiGLU). Its Hub checkpoints store the experts in MXFP4
(quantization_config quant_method "mxfp4"), dequantized on load (model/mxfp4.py); no other quantization."""
from __future__ import annotations

import math

from saguaro_dist.model.gemma3_config import gemma3_windows
from saguaro_dist.model.rope_checks import is_number

GPT_OSS_TYPE = "gpt_oss"
# GptOssConfig's defaults for the fields this runtime reads (a field config.json omits takes them)
_DEFAULTS = {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
             "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
             "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu",
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True}
_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
# GptOssConfig.__post_init__'s rope when config.json gives none (what the Hub files also say)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_PATTERN = 2  # GptOssConfig.__post_init__: layer i slides when (i + 1) % 2, i.e. every other layer from the first
MXFP4 = "mxfp4"


def gpt_oss_view(hf: dict) -> dict:
    """config.json as GptOssConfig reads it: every omitted field at its default, the default yarn rope when it
    names none (rope_parameters, or the Hub files' rope_scaling beside rope_theta), rope_theta 150000; the
    num_experts alias (GptOssConfig.attribute_map) as num_local_experts."""
    view = {**_DEFAULTS, **hf}
    if hf.get("num_experts") is not None and hf.get("num_local_experts") is None:
        view["num_local_experts"] = hf["num_experts"]
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        view["rope_parameters"] = dict(_DEFAULT_ROPE)
    view.setdefault("rope_theta", _DEFAULT_THETA)
    return view


def gpt_oss_windows(view: dict) -> tuple:
    """Each layer's sliding window (None: full attention): layer_types, else every other layer from the first."""
    return gemma3_windows(view, _PATTERN)


def _positive(view: dict, key: str, integer: bool = False):
    value = view[key]
    ok = isinstance(value, int) and not isinstance(value, bool) if integer else is_number(value)
    if not (ok and 0 < value < math.inf):
        kind = "an integer >= 1" if integer else "a finite number > 0"
        raise ValueError(f"config.json (model_type 'gpt_oss') {key} must be {kind}, got {value!r}")
    return value


def gpt_oss_fields(view: dict) -> dict:
    """The ModelConfig fields gpt-oss sets: sinks, weight-first norms (GptOssRMSNorm), every layer sparse, each
    expert intermediate_size wide with its SwiGLU's alpha and limit."""
    experts = _positive(view, "num_local_experts", integer=True)
    top_k = _positive(view, "num_experts_per_tok", integer=True)
    if top_k > experts:
        raise ValueError(f"config.json num_experts_per_tok {top_k} is more than the {experts} experts")
    return {"attention_sinks": True, "weight_first_norms": True, "num_experts": experts, "experts_per_token": top_k,
            "moe_intermediate_size": _positive(view, "intermediate_size", integer=True),
            "swiglu_alpha": float(_positive(view, "swiglu_alpha")),
            "swiglu_limit": float(_positive(view, "swiglu_limit")),
            "sparse_layers": (True,) * _positive(view, "num_hidden_layers", integer=True)}


def is_mxfp4(hf: dict) -> bool:
    """A gpt-oss checkpoint whose experts are MXFP4 (the Hub's): quantization_config quant_method "mxfp4". Its
    other tensors (attention, router, embeddings, head) are stored unquantized, as transformers expects."""
    quant = hf.get("quantization_config")
    return hf.get("model_type") == GPT_OSS_TYPE and isinstance(quant, dict) and quant.get("quant_method") == MXFP4
