"""Google Gemma 2's config.json (model_type "gemma2": Gemma2ForCausalLM, 2B / 9B / 27B) read as transformers
5.25's Gemma2Config reads it. Its layout is Gemma 3's (gemma3_config.py: sandwich norms, gelu-tanh MLP, scaled
embeddings, query_pre_attn_scalar, sliding layers) less the q / k norms and the sliding layers' own rope, plus
two tanh softcaps: of the attention scores (attention.softcapped_attention) and of the final logits."""
from __future__ import annotations

from saguaro_dist.model.gemma3_config import check_gemma_layout, gemma3_windows, without_ignored
from saguaro_dist.model.rope_checks import is_number

GEMMA2_TYPE = "gemma2"
# Gemma2Config's defaults for the fields this runtime reads (a field config.json omits takes them)
_DEFAULTS = {"vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
             "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
             "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
             "use_bidirectional_attention": None}
_PATTERN = 2  # Gemma2Config.__post_init__: layer i slides when (i + 1) % 2, i.e. every other layer from the first
_SOFTCAPS = {"attn_logit_softcapping": "attn_softcap", "final_logit_softcapping": "final_softcap"}


def gemma2_view(hf: dict) -> dict:
    """config.json as Gemma2Config reads it: every omitted field at its default, hidden_act (the Hub files'
    duplicate of hidden_activation, which transformers reads) and mlp_bias dropped."""
    return without_ignored({**_DEFAULTS, **hf})


def gemma2_windows(text: dict) -> tuple:
    """Each layer's sliding window (None: full attention): layer_types, else every other layer from the first."""
    return gemma3_windows(text, _PATTERN)


def _softcap(text: dict, key: str) -> float | None:
    value = text.get(key)
    if value is not None and not (is_number(value) and 0 < value < float("inf")):
        raise ValueError(f"config.json {key} must be a finite number > 0 or null (no softcap), got {value!r}")
    return None if value is None else float(value)


def gemma2_fields(text: dict) -> dict:
    """The ModelConfig fields Gemma 2 sets: Gemma 3's attention scale, embedding scale and layer layout (one
    rope: no local_rope), and its two softcaps."""
    check_gemma_layout(text)
    return {"attention_scale": text["query_pre_attn_scalar"] ** -0.5, "embed_scale": text["hidden_size"] ** 0.5,
            "sandwich_norms": True, **{field: _softcap(text, key) for key, field in _SOFTCAPS.items()}}
