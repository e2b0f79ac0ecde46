"""Microsoft Phi-3 (model_type "phi3": Phi-3-mini / -medium, Phi-3.5-mini, Phi-4, Phi-4-mini) as transformers 5.25's
Phi3Config reads config.json: a partial rotary factor, the rope dict (longrope only within its original context),
and the fused checkpoint tensors (qkv_proj, gate_up_proj) split into our q / k / v and gate / up on load."""
from __future__ import annotations

import functools
import logging
import math

from saguaro_dist.model.rope_checks import is_number

log = logging.getLogger(__name__)
PHI3_TYPE = "phi3"
_ORIGINAL_DEFAULT = 4096  # Phi3Config's original_max_position_embeddings when config.json has none
_ROPE_TYPES = ("default", "longrope")  # Phi3Config.validate_rope refuses every other type
_LONGROPE_ALIASES = ("su", "yarn")  # Phi3Config renames both to "longrope" (older Phi-3 config.json files)
_LONG_FACTOR_WHY = ("past it transformers switches every position to longrope's long_factor, re-rotating the keys "
                    "already cached; not computed here")


def _raw_rope(hf: dict) -> dict:
    """Phi3Config.convert_rope_params_to_dict: rope_scaling before rope_parameters; rope_theta and the top-level
    partial_rotary_factor filled in where the dict has none; su / yarn renamed longrope."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rope_type = rope.pop("type", None)
    rope_type = rope.get("rope_type", rope_type or "default")
    rope["rope_type"] = "longrope" if rope_type in _LONGROPE_ALIASES else rope_type
    return rope


def _head_dim(hf: dict) -> int:
    """hidden_size // num_attention_heads: what Phi3Config sizes the rope factors by; a config.json head_dim
    other than it is refused (transformers' attention and its rope checks would disagree on it)."""
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, head_dim):
        raise ValueError(f"config.json (model_type 'phi3') head_dim {hf['head_dim']!r} must be hidden_size // "
                         f"num_attention_heads = {head_dim} (or absent)")
    return head_dim


def rotary_dim(hf: dict, rope: dict) -> int:
    """The leading dims of each head that rotate: int(head_dim x partial_rotary_factor), even and >= 2."""
    factor, head_dim = rope["partial_rotary_factor"], _head_dim(hf)
    dim = int(head_dim * factor) if is_number(factor) and 0 < factor <= 1 else 0
    if dim < 2 or dim % 2:
        raise ValueError(f"config.json partial_rotary_factor {factor!r} must be a number in (0, 1] giving an even "
                         f"rotary dimension >= 2 of head_dim {head_dim} (got {dim})")
    return dim


def _original_length(hf: dict, rope: dict) -> int:
    """The pretraining context: config.json's top-level field (Phi3Config's default 4096), which transformers
    prefers to the rope dict's own; two different values are refused as ambiguous."""
    outer = hf.get("original_max_position_embeddings", _ORIGINAL_DEFAULT)
    inner = rope.get("original_max_position_embeddings", outer)
    if inner != outer or not (isinstance(outer, int) and not isinstance(outer, bool) and outer > 0):
        raise ValueError(f"config.json original_max_position_embeddings {outer!r} (top level; default "
                         f"{_ORIGINAL_DEFAULT}) and rope_scaling's {inner!r} must be one positive integer")
    return outer


def _check_factors(rope: dict, dim: int) -> None:
    """short_factor and long_factor: lists of dim / 2 positive numbers (Phi3Config.validate_rope's lengths)."""
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if not (isinstance(value, list) and len(value) == dim // 2 and all(is_number(x) and x > 0 for x in value)):
            raise ValueError(f"config.json rope_type 'longrope' {key} must be a list of {dim // 2} numbers > 0 "
                             f"(rotary dimension {dim} / 2), got {value!r}")


def _longrope_attention_factor(hf: dict, rope: dict, original: int) -> float:
    """transformers' _compute_longrope_parameters: attention_factor as given, else sqrt(1 + ln f / ln original)
    for f = factor, or max_position_embeddings / original when no factor is given (Phi-3's files); 1 if f <= 1."""
    for key in ("factor", "attention_factor"):
        if rope.get(key) is not None and not (is_number(rope[key]) and rope[key] > 0):
            raise ValueError(f"config.json rope_type 'longrope' {key} must be a number > 0, got {rope[key]!r}")
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def phi3_rope(hf: dict) -> dict:
    """The rope dict model/rope.py computes: default, or longrope by its short_factor (what transformers uses
    for every sequence within original_max_position_embeddings) with its attention factor resolved here
    (transformers derives it from max_position_embeddings, which the dict lacks)."""
    rope = _raw_rope(hf)
    if rope["rope_type"] not in _ROPE_TYPES:
        raise ValueError(f"config.json rope_type {rope['rope_type']!r} is not supported for model_type 'phi3' "
                         f"(Phi3Config accepts {', '.join(_ROPE_TYPES)})")
    dim = rotary_dim(hf, rope)
    if not is_number(rope["rope_theta"]) or rope["rope_theta"] <= 0:
        raise ValueError(f"config.json rope_theta must be a number > 0, got {rope['rope_theta']!r}")
    if rope["rope_type"] == "longrope":
        _check_factors(rope, dim)
        original = rope["original_max_position_embeddings"] = _original_length(hf, rope)
        rope["attention_factor"] = _longrope_attention_factor(hf, rope, original)
    return rope


def phi3_context(hf: dict, positions: int) -> tuple[int, str]:
    """(the longest context, where from): max_position_embeddings; with longrope at most its original
    context, where transformers' short factors hold for every position (warned when that caps it)."""
    rope = phi3_rope(hf)
    if rope["rope_type"] != "longrope" or positions <= rope["original_max_position_embeddings"]:
        return positions, "config.json max_position_embeddings"
    original = rope["original_max_position_embeddings"]
    _warn_capped(original, positions)
    return original, (f"config.json rope_scaling longrope original_max_position_embeddings {original}, not "
                      f"max_position_embeddings {positions}: {_LONG_FACTOR_WHY}")


@functools.lru_cache(maxsize=16)
def _warn_capped(original: int, positions: int) -> None:
    """Once a process per cap: a config is parsed by the driver, the API and each runner alike."""
    log.warning("phi3 longrope: context capped at original_max_position_embeddings %d (config.json "
                "max_position_embeddings %d): %s", original, positions, _LONG_FACTOR_WHY)


def phi3_fields(hf: dict) -> dict:
    """The ModelConfig fields Phi-3 sets: its rotary dimension when only part of each head rotates."""
    rope = phi3_rope(hf)
    dim = rotary_dim(hf, rope)
    return {"rotary_dim": dim if dim < _head_dim(hf) else None}


def fused_checkpoint_parts(cfg) -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's checkpoint tensors that hold several of our parameters, stacked by rows: (stored suffix ->
    (our projection, its rows) in order); q, k, v in qkv_proj, gate then up in gate_up_proj. {}: none."""
    if cfg.model_type != PHI3_TYPE:
        return {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"self_attn.qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "mlp.gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))}
