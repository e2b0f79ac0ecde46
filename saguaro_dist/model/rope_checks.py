"""Validation of a config.json's rope fields: only what model/rope.py computes as transformers does is let through."""
from __future__ import annotations

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_FIELDS = {"linear": ("factor",),  # what each type's frequencies read (model/rope.py)
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}
# Types whose frequencies depend on the sequence's current length: a key cached at one length would be rotated
# otherwise than the same key computed at another, and a round's positions span lengths.
_PER_LENGTH_ROPE_TYPES = {
    "dynamic": "dynamic NTK recomputes its frequencies from the sequence's length as it grows",
    "longrope": "longrope switches from its short to its long factors once the sequence passes "
                "original_max_position_embeddings",
}
_YARN_OPTIONAL_NUMBERS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rope_type(rope_type: str) -> None:
    if rope_type in _PER_LENGTH_ROPE_TYPES:
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported: {_PER_LENGTH_ROPE_TYPES[rope_type]}, "
                         "so cached keys would not be rotated as transformers rotates them "
                         f"(supported: {', '.join(_ROPE_TYPES)})")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")


def _check_scaling_values(rope: dict, rope_type: str) -> None:
    """The fields every scaling type shares: a positive factor, a positive whole original length."""
    factor = rope.get("factor")
    if "factor" in _ROPE_FIELDS.get(rope_type, ()) and not (is_number(factor) and factor > 0):
        raise ValueError(f"config.json rope_type {rope_type!r} factor must be a number > 0, got {factor!r}")
    old_len = rope.get("original_max_position_embeddings")
    if "original_max_position_embeddings" in _ROPE_FIELDS.get(rope_type, ()) and not (
            is_number(old_len) and old_len > 0 and old_len == int(old_len)):
        raise ValueError(f"config.json rope_type {rope_type!r} original_max_position_embeddings must be a positive "
                         f"integer, got {old_len!r}")


def _check_yarn_values(rope: dict, hf: dict) -> None:
    """What transformers' yarn reads (it only warns of the worst; here they are refused, never computed)."""
    for key in _YARN_OPTIONAL_NUMBERS:
        if rope.get(key) is not None and not is_number(rope[key]):
            raise ValueError(f"config.json rope_type 'yarn' {key} must be a number, got {rope[key]!r}")
    if rope.get("attention_factor") is not None and rope["attention_factor"] <= 0:  # it scales cos and sin
        raise ValueError(f"config.json rope_type 'yarn' attention_factor must be > 0, got {rope['attention_factor']!r}")
    for key in ("beta_fast", "beta_slow"):  # rotations over the original context; 0 means the default
        if rope.get(key) is not None and rope[key] < 0:
            raise ValueError(f"config.json rope_type 'yarn' {key} must be >= 0, got {rope[key]!r}")
    if (rope.get("beta_fast") or 32) < (rope.get("beta_slow") or 1):
        raise ValueError(f"config.json rope_type 'yarn' beta_fast ({rope.get('beta_fast')}, default 32) must not be "
                         f"less than beta_slow ({rope.get('beta_slow')}, default 1)")
    if rope.get("truncate") is not None and not isinstance(rope["truncate"], bool):  # null: falsy, as transformers
        raise ValueError(f"config.json rope_type 'yarn' truncate must be true or false, got {rope['truncate']!r}")


def _original_length(rope: dict, rope_type: str, hf: dict) -> None:
    """llama3's and yarn's pretraining context, as transformers 5's standardize_rope_params fills it: the rope
    dict's, else the top-level original_max_position_embeddings, else max_position_embeddings. Both given and
    different is refused: transformers 5 takes the top-level one, 4.x the dict's (ambiguous)."""
    if rope_type not in ("llama3", "yarn"):
        return
    outer, inner = hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")
    if outer is not None and inner is not None and outer != inner:
        raise ValueError(f"config.json original_max_position_embeddings {outer} differs from rope_scaling's "
                         f"{inner}: ambiguous (transformers 5 takes the top-level one, 4.x rope_scaling's), refused")
    if inner is None:
        rope["original_max_position_embeddings"] = outer if outer is not None else hf.get("max_position_embeddings")


def checked_rope(rope: dict, hf: dict) -> dict:
    """A rope dict (rope_theta set) validated, its rope_type filled in: what model/rope.py computes exactly,
    anything else refused here rather than mis-rotated."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _check_rope_type(rope_type)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1 is not supported")
    lacking = [k for k in _ROPE_FIELDS.get(rope_type, ()) if rope.get(k) is None]
    if set(lacking) - {"original_max_position_embeddings"}:  # refused here, not a KeyError in the tables
        raise ValueError(f"config.json rope_type {rope_type!r} lacks {', '.join(lacking)}")
    _original_length(rope, rope_type, hf)
    _check_scaling_values(rope, rope_type)
    if rope_type == "yarn":
        _check_yarn_values(rope, hf)
    rope["rope_type"] = rope_type
    return rope


