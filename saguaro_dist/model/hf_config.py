"""The model facts the runtime needs, read from a Hugging Face config.json and validated once."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from saguaro_dist.model.class_defaults import class_defaults_view
from saguaro_dist.model.fp8 import fp8_scheme
from saguaro_dist.model.gemma2_config import GEMMA2_TYPE, gemma2_fields, gemma2_view, gemma2_windows
from saguaro_dist.model.gemma3_config import (GEMMA3_TYPES, gemma3_fields, gemma3_ropes, gemma3_text_view,
                                              gemma3_windows)
from saguaro_dist.model.gpt_oss_config import GPT_OSS_TYPE, gpt_oss_fields, gpt_oss_view, gpt_oss_windows, is_mxfp4
from saguaro_dist.model.moe_config import MOE_TYPES, QWEN2_MOE_TYPE, moe_fields, moe_view
from saguaro_dist.model.phi3_config import PHI3_TYPE, phi3_context, phi3_fields, phi3_rope
from saguaro_dist.model.rope_checks import checked_rope, is_number
from saguaro_dist.model.smollm3_config import SMOLLM3_TYPE, smollm3_fields, smollm3_view, smollm3_windows

# model_type -> (q/k/v bias field ("": never a bias), o_proj bias with it, q/k RMSNorm per head)
# (transformers' modeling code: Mistral's and Mixtral's attention hard-code bias=False, whatever config.json says)
_FAMILIES = {"llama": ("attention_bias", True, False), "mistral": ("", False, False),
             "qwen2": (None, False, False), "qwen3": ("attention_bias", True, True),
             "granite": ("attention_bias", True, False), "olmo2": ("attention_bias", True, False),
             "gemma2": ("attention_bias", True, False), "gemma3_text": ("attention_bias", True, True), "gemma3": ("attention_bias", True, True),
             "mixtral": ("", False, False), "qwen3_moe": ("attention_bias", True, True), "phi3": ("", False, False),
             "qwen2_moe": ("qkv_bias", False, False), "olmoe": ("attention_bias", True, False),
             "gpt_oss": ("attention_bias", True, False), "smollm3": ("attention_bias", True, False)}
# When transformers has no config class to fill omitted fields (class_defaults.py): the classes' defaults
_DEFAULT_EPS = {"olmo2": 1e-5, "phi3": 1e-5, "mixtral": 1e-5}  # rms_norm_eps (else 1e-6)
_DEFAULT_THETA = {"mixtral": 1e6}  # rope_theta (else 10000)
# The families whose dense MLP reads mlp_bias (LlamaMLP, GraniteMLP, SmolLM3MLP); the others' hard-code bias=False
_MLP_BIAS_TYPES = ("llama", "granite", SMOLLM3_TYPE)
# Granite's scalars (GraniteConfig): transformers' default 1.0 for each one config.json omits
_GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
_DEFAULT_WINDOW = 4096  # transformers' Mistral/Qwen2/Qwen3Config sliding_window when config.json has none
# The rope types whose `factor` stretches the context past max_position_embeddings (vLLM's _get_and_verify_max_len:
# every type but su / longrope / llama3). llama3's max_position_embeddings already is its extended length; yarn
# stretches its original_max_position_embeddings instead.
_EXTENDING_ROPE_TYPES = ("linear", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int   # the longest context computed exactly: context_limit, rope scaling included
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict                     # rope_type, rope_theta and the type's own fields
    eos_token_ids: tuple[int, ...]
    hf: dict = field(repr=False)   # the raw config.json
    context_source: str = "config.json max_position_embeddings"  # where max_position_embeddings comes from (errors)
    # Granite's scalars; the defaults add no op (layers.py skips a multiplier of 1 and a scale of None)
    embedding_multiplier: float = 1.0  # the embeddings times it
    residual_multiplier: float = 1.0   # each sublayer's output times it, before the residual add
    attention_scale: float | None = None  # SDPA's scale; None: its own 1/sqrt(head_dim)
    logits_scaling: float = 1.0        # the logits divided by it
    post_norms: bool = False  # OLMo 2: norms after each sublayer (none before), q / k norms over whole projections
    rope_fp32: bool = False   # OLMo 2: the runner's cos / sin tables stay fp32, so q and k rotate in fp32, cast after
    layer_windows: tuple = ()  # each layer's sliding window (None: full attention); (): no layer slides
    # Gemma 3's (gemma3_config.py); the defaults add no op
    embed_scale: float | None = None  # the embeddings times it, rounded to the model's dtype first
    sandwich_norms: bool = False  # norms before and after each sublayer, x * (1 + weight) in fp32; gelu-tanh MLP
    local_rope: dict | None = None  # the sliding layers' own rope; None: every layer rotates by `rope`
    language_model_only: bool = False  # a multimodal checkpoint ("gemma3"): only its language model is loaded
    # Gemma 2's tanh softcaps, cap * tanh(x / cap) (gemma2_config.py); None: no op, and attention by SDPA
    attn_softcap: float | None = None   # of the attention scores, before the mask (attention.softcapped_attention)
    final_softcap: float | None = None  # of the logits
    # Mixtral's, Qwen3-MoE's, Qwen2-MoE's and OLMoE's sparse MLPs (model/moe.py); the defaults: a dense model
    num_experts: int = 0              # routed experts of a sparse layer
    experts_per_token: int = 0        # top-k experts each token is sent to
    moe_intermediate_size: int = 0    # each expert's SwiGLU width
    renormalise_topk: bool = False    # the top-k routing weights divided by their sum
    routing_weights_fp32: bool = False  # Mixtral: the weights stay fp32 into the weighted sum; Qwen3-MoE: cast
    sparse_layers: tuple = ()         # each layer: True sparse (experts), False dense MLP; (): none sparse
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated) beside the routed; 0: none
    projection_qk_norms: bool = False  # OLMoE's: q / k RMS-normalised over whole projections, Llama's pre-norms
    qkv_clip: float | None = None      # OLMoE's clip_qkv: q / k (after their norms) and v clamped to +-it
    rotary_dim: int | None = None  # Phi-3's partial rotary factor: rope on each head's first rotary_dim dims; None: all
    # gpt-oss's (gpt_oss_config.py); the defaults add no op
    attention_sinks: bool = False      # a learned logit per head in each softmax (attention.sink_attention)
    weight_first_norms: bool = False   # RMSNorm's weight times the fp32 normalised input, then the cast (as OLMo 2's)
    swiglu_alpha: float | None = None  # the experts' clamped SwiGLU (moe.ClampedSwiGLUExpert); None: plain SwiGLU
    swiglu_limit: float | None = None
    rope_layers: tuple = ()  # SmolLM3's: each layer True rotates, False is NoPE (no rope); (): every layer rotates

    @property
    def eos_token_id(self) -> tuple[int, ...]:
        return self.eos_token_ids

    @property
    def rope_dim(self) -> int:
        """The width of the rope tables: the dims of each head that rotate."""
        return self.rotary_dim or self.head_dim

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window: a query at position i sees keys i - window < j <= i; None: all j <= i."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rotates(self, layer: int) -> bool:
        """Layer `layer`'s q and k rotate by the rope (else NoPE: SmolLM3's no_rope_layers)."""
        return not self.rope_layers or self.rope_layers[layer]

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a sparse mixture of experts (else the dense MLP of intermediate_size)."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]


def read_config_json(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"missing config.json: {path} does not exist")
    return json.loads(path.read_text())


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"config.json lacks the field {key!r}")
    return hf[key]


def rope_params(hf: dict) -> dict:
    """Both layouts: transformers>=5 `rope_parameters`, older `rope_theta` + `rope_scaling`; Gemma 3's full
    layers' (its sliding layers': gemma3_config.gemma3_ropes)."""
    if hf.get("model_type") in GEMMA3_TYPES:
        return gemma3_ropes(gemma3_text_view(hf))["full_attention"]
    if hf.get("model_type") == PHI3_TYPE:
        return phi3_rope(hf)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_THETA.get(hf.get("model_type"), 10000.0)))
    return checked_rope(rope, hf)


def rope_length_factor(rope: dict) -> float:
    """How far a rope type's scaling stretches the context: its factor for linear (positions divided by it) and
    yarn (of original_max_position_embeddings), 1 for default and llama3 (whose max_position_embeddings is
    already the extended length)."""
    return float(rope["factor"]) if rope["rope_type"] in _EXTENDING_ROPE_TYPES else 1.0


def _scaled_positions(positions: int, rope: dict) -> tuple[int, str]:
    """(the positions the rope scaling reaches, where from), as vLLM derives max_model_len: yarn stretches
    its original_max_position_embeddings, linear the config's max_position_embeddings."""
    factor = rope_length_factor(rope)
    source = "config.json max_position_embeddings"
    if rope["rope_type"] == "yarn":
        old_len = rope["original_max_position_embeddings"]
        source = f"config.json rope_scaling yarn original_max_position_embeddings {old_len} x factor {rope['factor']}"
        return int(old_len * factor), source
    if factor != 1.0:
        source = f"{source} {positions} x rope_scaling {rope['rope_type']} factor {rope['factor']}"
    return int(positions * factor), source  # int(), as vLLM's derived max_model_len


def _sliding_window(hf: dict) -> int | None:
    """The sliding window that applies to this checkpoint, else None. Mistral's, Mixtral's and Phi-3's apply
    unless null, Qwen's only when used; absent, it is the config class's default (MixtralConfig's and
    Phi3Config's: null), as transformers reads the file."""
    model_type = hf["model_type"]
    applies = model_type in ("mistral", "mixtral", PHI3_TYPE) or (
        model_type in ("qwen2", "qwen3", "qwen3_moe", QWEN2_MOE_TYPE) and hf.get("use_sliding_window"))
    default = None if model_type in ("mixtral", PHI3_TYPE) else _DEFAULT_WINDOW
    window = hf.get("sliding_window", default) if applies else None
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise ValueError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    return window


def _qwen_layer_types(hf: dict, window: int | None, num_layers: int) -> list[str]:
    """Qwen2 / Qwen3Config's layer_types: config.json's own (transformers writes them), else "sliding_attention"
    from max_window_layers (default 28) on when a window applies; its legacy "attention" is "full_attention"."""
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]
    types = ["full_attention" if t == "attention" else t for t in types]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types must give each of the {num_layers} layers 'full_attention' or "
                         f"'sliding_attention', got {hf['layer_types']!r}")
    if window is None and "sliding_attention" in types:  # transformers' forward raises on it
        raise ValueError("config.json layer_types has 'sliding_attention' layers but no sliding window applies "
                         "(sliding_window null, or use_sliding_window false)")
    return types


def layer_windows(hf: dict, num_layers: int) -> tuple:
    """Each layer's sliding window (None: full attention), as transformers' modeling applies them: Mistral's,
    Mixtral's and Qwen3-MoE's on every layer, Qwen2 / Qwen3's and Gemma 2 / 3's on the layers layer_types marks
    "sliding_attention"; () when none slides."""
    if hf["model_type"] == GEMMA2_TYPE:
        windows = gemma2_windows(gemma2_view(hf))
    elif hf["model_type"] == GPT_OSS_TYPE:
        windows = gpt_oss_windows(gpt_oss_view(hf))
    elif hf["model_type"] in GEMMA3_TYPES:
        windows = gemma3_windows(gemma3_text_view(hf))
    elif hf["model_type"] == SMOLLM3_TYPE:
        windows = smollm3_windows(hf)
    elif hf["model_type"] in ("qwen2", "qwen3", QWEN2_MOE_TYPE):  # Qwen2-MoE's layer_types: moe_config.moe_view
        window = _sliding_window(hf)
        windows = tuple(window if t == "sliding_attention" else None
                        for t in _qwen_layer_types(hf, window, num_layers))
    else:
        window = _sliding_window(hf)
        windows = (window,) * num_layers if window is not None else ()
    return windows if any(w is not None for w in windows) else ()


def context_limit(hf: dict) -> tuple[int, str]:
    """(the longest context, where it comes from): max_position_embeddings, times the rope scaling factor for
    the types that extend the context (yarn: original_max_position_embeddings times it; vLLM's rule). A
    sliding window does not bound it: sliding layers attend over their window of the stored KV (all kept).
    Gemma 3's is max_position_embeddings, its rope scaling already counted there (vLLM skips gemma3's factor)."""
    if hf.get("model_type") in GEMMA3_TYPES:
        return _require(gemma3_text_view(hf), "max_position_embeddings"), "config.json max_position_embeddings"
    if hf.get("model_type") == PHI3_TYPE:  # longrope: its original context only (phi3_config.phi3_context)
        return phi3_context(hf, _require(hf, "max_position_embeddings"))
    return _scaled_positions(_require(hf, "max_position_embeddings"), rope_params(hf))


def _model_type(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type not in _FAMILIES:
        archs = hf.get("architectures")
        raise ValueError(f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}); "
                         f"supported model_type: {', '.join(_FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    return model_type


def _check_unquantized(hf: dict) -> None:
    """Quantized weights need scales and kernels: gpt-oss's MXFP4 experts (model/mxfp4.py) and FP8 checkpoints'
    weights (model/fp8.py) are dequantized on load; any other quantization (GPTQ, AWQ, ...) is refused."""
    quant = hf.get("quantization_config")
    if not quant or is_mxfp4(hf):
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if hf["model_type"] == GPT_OSS_TYPE or method == "mxfp4":  # gpt-oss's experts are stacked: not FP8's layout
        raise ValueError(f"config.json has a quantization_config (quant_method {method!r}) on model_type "
                         f"{hf['model_type']!r}: not supported (but gpt-oss's mxfp4 experts, dequantized on load)")
    fp8_scheme(hf)  # raises naming any quantization but FP8's


def _granite_scalars(hf: dict) -> dict:
    """Granite's four scalars as ModelConfig fields; each a finite number > 0 (a zero logits_scaling divides
    by zero; a negative or non-finite one was never trained), else refused."""
    values = {key: hf.get(key, 1.0) for key in _GRANITE_SCALARS}
    for key, value in values.items():
        if not (is_number(value) and 0 < value < float("inf")):
            raise ValueError(f"config.json (model_type 'granite') {key} must be a finite number > 0, got {value!r}")
    return {"embedding_multiplier": float(values["embedding_multiplier"]),
            "residual_multiplier": float(values["residual_multiplier"]),
            "attention_scale": float(values["attention_multiplier"]),
            "logits_scaling": float(values["logits_scaling"])}


def _family_fields(model_type: str, hf: dict) -> dict:
    """The ModelConfig fields only some families set (Granite's scalars, OLMo 2's norm layout, Gemma 3's,
    the MoE families' experts (moe_config.py), Phi-3's rotary dimension, gpt-oss's sinks and experts)."""
    if model_type == "granite":
        return _granite_scalars(hf)
    if model_type == "olmo2":
        return {"post_norms": True, "rope_fp32": True}
    if model_type in GEMMA3_TYPES:
        return gemma3_fields(hf)
    if model_type == GEMMA2_TYPE:
        return gemma2_fields(hf)
    if model_type in MOE_TYPES:
        return moe_fields(hf)
    if model_type == PHI3_TYPE:
        return phi3_fields(hf)
    if model_type == GPT_OSS_TYPE:
        return gpt_oss_fields(hf)
    if model_type == SMOLLM3_TYPE:
        return smollm3_fields(hf)
    return {}


def parse_config(hf: dict) -> ModelConfig:
    hf = class_defaults_view(hf)  # omitted fields at transformers' config class's defaults
    if hf.get("model_type") in GEMMA3_TYPES:  # Gemma 3's language model, its defaults filled in (a view)
        hf = gemma3_text_view(hf)
    elif hf.get("model_type") == GEMMA2_TYPE:  # Gemma 2's defaults filled in
        hf = gemma2_view(hf)
    elif hf.get("model_type") == GPT_OSS_TYPE:  # gpt-oss's defaults filled in (its rope's too)
        hf = gpt_oss_view(hf)
    elif hf.get("model_type") == SMOLLM3_TYPE:  # SmolLM3's defaults filled in (its rope_theta's too)
        hf = smollm3_view(hf)
    hf = moe_view(hf)  # Qwen2-MoE's / OLMoE's defaults filled in (any other family's as it is)
    model_type = _model_type(hf)
    _check_unquantized(hf)
    bias_key, o_bias, qk_norm = _FAMILIES[model_type]
    qkv_bias = True if bias_key is None else bool(bias_key) and bool(hf.get(bias_key, False))
    heads = _require(hf, "num_attention_heads")
    hidden = _require(hf, "hidden_size")
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % kv_heads:  # each key/value head serves a whole group of query heads
        raise ValueError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eos = hf.get("eos_token_id")
    limit, limit_source = context_limit(hf)
    num_layers = _require(hf, "num_hidden_layers")
    return ModelConfig(
        model_type=model_type, vocab_size=_require(hf, "vocab_size"), hidden_size=hidden,
        intermediate_size=_require(hf, "intermediate_size"), num_layers=num_layers,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", _DEFAULT_EPS.get(model_type, 1e-6)),
        max_position_embeddings=limit, context_source=limit_source,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=qkv_bias and o_bias, mlp_bias=model_type in _MLP_BIAS_TYPES and bool(hf.get("mlp_bias", False)), qk_norm=qk_norm,
        rope=rope_params(hf), eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
        hf=hf, layer_windows=layer_windows(hf, num_layers), **_family_fields(model_type, hf))


def load_config(model_dir: str | Path) -> ModelConfig:
    return parse_config(read_config_json(Path(model_dir)))
