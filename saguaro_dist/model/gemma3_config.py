"""Google Gemma 3's config.json read as transformers 5.25's Gemma3TextConfig reads it: model_type "gemma3_text"
(Gemma3ForCausalLM: 270M, 1B) or "gemma3" (Gemma3ForConditionalGeneration, 4B-27B), whose nested text_config
lists only the fields that differ from the class's defaults; only its language model is run here."""
from __future__ import annotations

from saguaro_dist.model.rope_checks import checked_rope, is_number

GEMMA3_TYPES = ("gemma3_text", "gemma3")
# Gemma3TextConfig's defaults for the fields this runtime reads (a field config.json omits takes them)
_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                  "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
                  "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
                  "attn_logit_softcapping": None, "use_bidirectional_attention": False}
# Fields a multimodal config.json keeps at its top level that say something of its language model too
_OUTER_FIELDS = ("eos_token_id", "tie_word_embeddings", "torch_dtype", "dtype")
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta
_THETA_KEYS = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_PATTERN = 6  # Gemma3TextConfig: every 6th layer full when config.json has no layer_types
_SUPPORTED_ACT = "gelu_pytorch_tanh"
_MULTIMODAL = "_language_model_of_multimodal"  # the view's own key (no config.json has it): a "gemma3" file's


def gemma3_text_view(hf: dict) -> dict:
    """The language model's config as transformers reads it: a "gemma3" file's text_config (its top-level
    eos / tie / dtype fields where the text_config has none), every omitted field at its default."""
    if hf.get("model_type") != "gemma3":
        return without_ignored({**_TEXT_DEFAULTS, **hf, "model_type": "gemma3_text"})
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"config.json (model_type 'gemma3') text_config must be an object, got {text!r}")
    outer = {k: hf[k] for k in _OUTER_FIELDS if hf.get(k) is not None}
    return without_ignored({**_TEXT_DEFAULTS, **outer, **text, "model_type": "gemma3_text",
                             "architectures": hf.get("architectures"),
                             "quantization_config": hf.get("quantization_config"), _MULTIMODAL: True})


def without_ignored(text: dict) -> dict:
    """Fields other families read that Gemma2Config / Gemma3TextConfig have not (their MLPs have no bias; their
    activation is hidden_activation): dropped, so they mean here what they mean to transformers, nothing."""
    return {k: v for k, v in text.items() if k not in ("mlp_bias", "hidden_act")}


def gemma3_layer_types(text: dict, pattern: int | None = None) -> list[str]:
    """Each layer's type: config.json's layer_types, else sliding but every pattern-th layer (Gemma 3's
    sliding_window_pattern; Gemma 2 passes its fixed 2: Gemma2Config reads no pattern)."""
    num_layers = text["num_hidden_layers"]
    types = text.get("layer_types")
    if types is None:
        pattern = text.get("sliding_window_pattern", _DEFAULT_PATTERN) if pattern is None else pattern
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(_LAYER_TYPES):
        raise ValueError(f"config.json layer_types must give each of the {num_layers} layers 'full_attention' or "
                         f"'sliding_attention', got {types!r}")
    return types


def gemma3_ropes(text: dict) -> dict[str, dict]:
    """Each layer type's rope (Gemma3TextConfig.convert_rope_params_to_dict): rope_parameters nested by layer
    type, or the older rope_scaling (the full layers') with rope_theta (full) and rope_local_base_freq (sliding)."""
    nested = text.get("rope_parameters") or {}
    if not isinstance(nested, dict) or not set(nested) <= set(_LAYER_TYPES):
        raise ValueError("config.json (Gemma 3) rope_parameters must be nested by layer type ('full_attention', "
                         f"'sliding_attention'), got {nested!r}")
    ropes = {kind: dict(nested.get(kind) or {"rope_type": "default"}) for kind in _LAYER_TYPES}
    if text.get("rope_scaling") is not None:
        ropes["full_attention"].update(text["rope_scaling"])
    for kind, rope in ropes.items():
        theta = text.get(_THETA_KEYS[kind])
        rope.setdefault("rope_theta", _DEFAULT_THETA[kind] if theta is None else theta)
        if rope.get("rope_type", rope.get("type")) in ("llama3", "yarn"):  # standardize_rope_params' nested case
            rope.setdefault("original_max_position_embeddings", text["max_position_embeddings"])
    return {kind: checked_rope(rope, text) for kind, rope in ropes.items()}


def gemma3_windows(text: dict, pattern: int | None = None) -> tuple:
    """Each layer's sliding window: sliding_window on the sliding layers, None (full attention) on the others."""
    types = gemma3_layer_types(text, pattern)
    window = text.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise ValueError(f"config.json sliding_window must be a positive integer, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _check_supported(text: dict) -> None:
    """What transformers computes for Gemma 3 that this runtime does not: refused, naming the field."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            raise ValueError(f"config.json {key} {text[key]!r} is not supported: softcapping must be null (SDPA "
                             "cannot softcap the scores; Gemma 3 ships both null)")
    check_gemma_layout(text)


def check_gemma_layout(text: dict) -> None:
    """What Gemma 2 and 3 share and this runtime computes only one way: a causal decoder, gelu-tanh MLPs, a
    finite positive query_pre_attn_scalar; anything else refused, naming the field."""
    if text.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention true is not supported (a causal decoder only)")
    if text.get("hidden_activation") != _SUPPORTED_ACT:
        raise ValueError(f"config.json hidden_activation {text.get('hidden_activation')!r} is not supported "
                         f"(only {_SUPPORTED_ACT!r})")
    scalar = text.get("query_pre_attn_scalar")
    if not (is_number(scalar) and 0 < scalar < float("inf")):
        raise ValueError(f"config.json query_pre_attn_scalar must be a finite number > 0, got {scalar!r}")


def gemma3_fields(text: dict) -> dict:
    """The ModelConfig fields Gemma 3 sets: its attention scale, embedding scale, layer layout (norms, gelu-tanh
    MLP) and the sliding layers' own rope."""
    _check_supported(text)
    return {"attention_scale": text["query_pre_attn_scalar"] ** -0.5, "embed_scale": text["hidden_size"] ** 0.5,
            "sandwich_norms": True, "local_rope": gemma3_ropes(text)["sliding_attention"],
            "language_model_only": bool(text.get(_MULTIMODAL))}
