"""Hugging Face SmolLM3's config.json (model_type "smollm3": SmolLM3ForCausalLM, e.g. SmolLM3-3B) read as
transformers 5.25's SmolLM3Config reads it. Llama's layout but for NoPE layers: `no_rope_layers[i]` 1 rotates
layer i's q and k by the rope, 0 leaves them unrotated (no position encoding); absent, every
`no_rope_layer_interval`-th layer (the 4th, 8th, ...) is NoPE. Sliding layers, where configured, are by default
the NoPE ones."""
from __future__ import annotations

SMOLLM3_TYPE = "smollm3"
# SmolLM3Config's defaults for the fields this runtime reads (a field config.json omits takes them); its rope's
# default_theta is 2e6, not the 1e4 other families default to
_DEFAULTS = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
             "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
             "rms_norm_eps": 1e-6, "eos_token_id": 128001, "tie_word_embeddings": True,
             "use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4}
_DEFAULT_THETA = 2_000_000.0
_LAYER_TYPES = ("full_attention", "sliding_attention")


def smollm3_view(hf: dict) -> dict:
    """config.json as SmolLM3Config reads it: every omitted field at its default (rope_theta's only where no
    rope_parameters / rope_scaling gives one)."""
    view = {**_DEFAULTS, **hf}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_theta") is None and hf.get("rope_theta") is None:
        view["rope_theta"] = _DEFAULT_THETA
    return view


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def smollm3_rope_layers(hf: dict) -> tuple[bool, ...]:
    """Each layer: True rotates by the rope, False is NoPE. no_rope_layers (1 rope, 0 NoPE; SmolLM3Attention
    indexes it by layer, so a longer list's tail is unused), else NoPE on each layer whose (index + 1) is a
    multiple of no_rope_layer_interval (SmolLM3Config.__post_init__)."""
    layers, flags = hf["num_hidden_layers"], hf.get("no_rope_layers")
    if flags is None:
        interval = hf["no_rope_layer_interval"]
        if not (_is_int(interval) and interval > 0):
            raise ValueError(f"config.json (model_type 'smollm3') no_rope_layer_interval must be an integer >= 1, "
                             f"got {interval!r}")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not (isinstance(flags, list) and len(flags) >= layers and all(f in (0, 1) for f in flags)):
        raise ValueError(f"config.json (model_type 'smollm3') no_rope_layers must list 1 (rope) or 0 (NoPE) for "
                         f"each of the {layers} layers, got {flags!r}")
    return tuple(bool(f) for f in flags[:layers])


def _layer_types(hf: dict, rope_layers: tuple[bool, ...]) -> list[str]:
    """SmolLM3Config's layer_types: config.json's own, else "sliding_attention" on the NoPE layers when
    use_sliding_window and a sliding_window are set."""
    types, layers = hf.get("layer_types"), len(rope_layers)
    if types is None:
        slides = bool(hf["use_sliding_window"]) and hf["sliding_window"] is not None
        return ["sliding_attention" if slides and not rope else "full_attention" for rope in rope_layers]
    if not (isinstance(types, list) and len(types) == layers and set(types) <= set(_LAYER_TYPES)):
        raise ValueError(f"config.json layer_types must give each of the {layers} layers 'full_attention' or "
                         f"'sliding_attention', got {types!r}")
    return types


def smollm3_windows(hf: dict) -> tuple:
    """Each layer's sliding window (None: full attention): sliding_window on the layers layer_types marks
    "sliding_attention". transformers' SDPA / eager masks slide there whatever use_sliding_window says, its
    flash attention only with it: a sliding layer without both is refused, not guessed."""
    types = _layer_types(hf, smollm3_rope_layers(hf))
    window = hf["sliding_window"]
    if "sliding_attention" not in types:
        return (None,) * len(types)
    if not hf["use_sliding_window"] or window is None:
        raise ValueError("config.json layer_types has 'sliding_attention' layers but use_sliding_window is false "
                         "or sliding_window null: transformers' attention implementations disagree on them")
    if not (_is_int(window) and window > 0):
        raise ValueError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def smollm3_fields(hf: dict) -> dict:
    """The ModelConfig field SmolLM3 sets: which layers rotate (the attention's rotate is chosen per layer
    once, at build: a NoPE layer runs no rope op, every other model's layers are unchanged)."""
    rope_layers = smollm3_rope_layers(hf)
    return {"rope_layers": rope_layers if not all(rope_layers) else ()}
