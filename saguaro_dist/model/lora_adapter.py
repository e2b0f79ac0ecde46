"""PEFT LoRA adapters read from disk (adapter_config.json + adapter_model.safetensors, else vLLM's fallbacks
adapter_model.bin / .pt, read with torch.load(weights_only=True)) and checked against the base
model, as vLLM's PEFTHelper.validate_legal / LoRAModel.from_local_checkpoint do (vllm/lora/peft_helper.py,
lora_model.py): DoRA, modules_to_save, an adapter bias, a rank above max_lora_rank and tensors for modules the
model cannot adapt are refused. Phi-3's checkpoints hold fused qkv_proj / gate_up_proj modules, so its adapters
target those (one LoRA over the fused output each) instead of q / k / v and gate / up. Also refused here: options
that change the forward this module does not compute (lora_bias, rank/alpha patterns, fan_in_fan_out, trainable
tokens, layer replication, ...), and shapes that are not the base model's. layers_to_transform is supported: a
layer the adapter has no tensors for runs as the base model."""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from safetensors import safe_open

from saguaro_dist.model.hf_config import ModelConfig
from saguaro_dist.model.phi3_config import PHI3_TYPE

CONFIG_FILE = "adapter_config.json"
# the tensors' file, the first present (vLLM's LoRAModel.from_local_checkpoint order: safetensors, then PyTorch pickles)
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's modules (its checkpoint's names)
_NOT_LINEAR_TARGETS = ("embed_tokens", "lm_head")  # vLLM adapts them with extra vocabulary; not done here
# adapter_config.json keys whose non-empty value changes the forward in a way not computed here, and why
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported (vLLM refuses it too)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported (as vLLM)",
    "lora_bias": "a bias on lora_B is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out describes Conv1D weights stored [in, out]; these models' projections are "
                      "nn.Linear [out, in]",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "layer_replication": "layer_replication (a deeper model built from the base's layers) is not supported",
    "target_parameters": "LoRA on raw parameters (target_parameters, MoE experts) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA is not supported",
}
# Phrases of the refusals below (and of the loader's Hub failure) that mean no adapter is at the path, vLLM's
# LoRAAdapterNotFoundError: the target's check reaches a server as text (on Ray, rank 0's reply), which answers 404
_NO_ADAPTER = ("is not a directory and not a Hugging Face id", f"no {CONFIG_FILE} in",
               "the Hugging Face Hub could not provide it")
_LAYERS = r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
_KEY = re.compile(r"(?:base_model\.model\.)?model" + _LAYERS)
# A multimodal checkpoint's (Gemma 3 4B-27B): PEFT names its language model's layers as transformers does (4.52+:
# model.language_model.layers, before: language_model.model.layers), the layouts vLLM's Gemma3ForConditionalGeneration
# hf_to_vllm_mapper takes and the model loader reads (loader.language_model_name)
_MULTIMODAL_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.language_model|language_model\.model)" + _LAYERS)
_TOWERS = re.compile(r"(?:base_model\.model\.)?(?:model\.)?(?:vision_tower|multi_modal_projector)\.")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's full (unsharded) weights: weights[(layer, module)] = (A [r, in], B [out, r]); each row
    adapted as y += scale * (x @ A^T) @ B^T. module: one of adapter_targets(cfg) (a fused one's B is as wide
    as all its parts, q then k then v or gate then up)."""
    source: str
    rank: int
    scale: float
    weights: dict

    def cast(self, dtype) -> LoRAAdapter:
        """The same adapter in `dtype` (the runner's: its slots hold that dtype anyway), half the bytes of the fp32
        read for bf16 where it travels (the tensor-parallel replay pickles it through each rank's device) or
        waits in host memory."""
        return replace(self, weights={key: (a.to(dtype), b.to(dtype)) for key, (a, b) in self.weights.items()})


def local_adapter_dir(path) -> Path | None:
    """The folder `path` names on this machine, or None: none there, or a path no folder can have (~user of an
    unknown user: expanduser's RuntimeError; a name too long for the file system: is_dir's OSError)."""
    try:
        folder = Path(path).expanduser()
        return folder if folder.is_dir() else None
    except (RuntimeError, OSError):
        return None


def resolve_adapter_dir(path_or_id, revision: str | None = None) -> Path:
    """A local folder as it is; else a Hugging Face id, its adapter files fetched as the model loader does."""
    from saguaro_dist.model.loader import _hub_snapshot
    folder = local_adapter_dir(path_or_id)
    if folder is not None:
        return folder
    name = str(path_or_id)
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or _exists(name):
        raise ValueError(f"LoRA adapter {name!r} is not a directory and not a Hugging Face id (owner/name)")
    return _hub_snapshot(name, revision, [CONFIG_FILE, *WEIGHTS_FILES])


def names_no_adapter(message: str) -> bool:
    """Whether a refusal of an adapter says that none is at its path (rather than one that cannot run)."""
    return any(phrase in message for phrase in _NO_ADAPTER)


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name too long for the file system: nothing is there
        return False


def load_adapter(path_or_id, cfg: ModelConfig, max_lora_rank: int, revision: str | None = None) -> LoRAAdapter:
    """Read and check an adapter for the model `cfg` describes (every refusal a ValueError naming the key)."""
    folder = resolve_adapter_dir(path_or_id, revision)
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter {path_or_id}: no {CONFIG_FILE} in {folder}")
    weights_file = next((folder / name for name in WEIGHTS_FILES if (folder / name).is_file()), None)
    if weights_file is None:
        raise ValueError(f"LoRA adapter {path_or_id}: no {WEIGHTS_FILES[0]} (nor {' / '.join(WEIGHTS_FILES[1:])}) "
                         f"in {folder}")
    try:
        conf = json.loads((folder / CONFIG_FILE).read_text())
        if not isinstance(conf, dict):
            raise ValueError(f"{CONFIG_FILE} must hold a JSON object, got a {type(conf).__name__}")
        rank, scale = checked_config(conf, max_lora_rank)
        weights = read_weights(weights_file, cfg, rank)
    except ValueError as err:  # (json's JSONDecodeError among them)
        raise ValueError(f"LoRA adapter {path_or_id}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a file that is no safetensors (SafetensorError), an unsafe pickle
        raise ValueError(f"LoRA adapter {path_or_id}: {weights_file.name} cannot be read: {type(err).__name__}: "
                         f"{err}") from None
    return LoRAAdapter(str(path_or_id), rank, scale, weights)


def checked_config(conf: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scale) of an adapter_config.json: alpha / sqrt(r) with use_rslora, else alpha / r."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {conf.get('peft_type')!r}: only LORA adapters are supported")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise ValueError(f"r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"r: LoRA rank {r} is greater than max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"bias {conf['bias']!r}: adapter biases are not supported (vLLM refuses them too)")
    for key, why in _UNSUPPORTED.items():
        if conf.get(key):
            raise ValueError(f"{key}: {why}")
    check_targets(conf.get("target_modules"))
    return r, alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r


def check_targets(targets) -> None:
    """target_modules, a list (names matched as suffixes) or a regex string (matched in full, as PEFT does):
    neither may name the embedding or the LM head."""
    if isinstance(targets, str):
        try:
            hit = [n for n in ("model.embed_tokens", "lm_head") if targets != "all-linear" and re.fullmatch(targets, n)]
        except re.error as err:  # (not a ValueError: load_adapter would call the weights file unreadable)
            raise ValueError(f"target_modules {targets!r} in {CONFIG_FILE} is no valid regex: {err}") from None
    elif isinstance(targets, list):
        hit = [t for t in targets if str(t).rsplit(".", 1)[-1] in _NOT_LINEAR_TARGETS]
    else:
        raise ValueError(f"target_modules must be a list or a regex string, got {targets!r}")
    if hit:
        raise ValueError(f"target_modules {targets!r} names {', '.join(hit)}: LoRA on the embedding or the LM head "
                         "is not supported (only the decoder layers' projections)")


def adapter_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The modules an adapter for this model may adapt: the base checkpoint's own (PEFT wraps those)."""
    return FUSED_TARGETS if cfg.model_type == PHI3_TYPE else TARGETS


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable projection's full (out, in) in the base model, the fused ones included."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}


def read_weights(file: Path, cfg: ModelConfig, rank: int) -> dict:
    """{(layer, module): (A, B)} in fp32, every tensor's name and shape checked against the base model."""
    shapes, parts = module_shapes(cfg), {}
    with _open_tensors(file) as (keys, shape_of, tensor):
        for key in keys:
            layer, module, which = _parse_key(key, cfg)
            out, inp = shapes[module]
            want = (rank, inp) if which == "A" else (out, rank)
            got = shape_of(key)
            if got != want:
                raise ValueError(f"{key} has shape {list(got)}, the base model's {module} needs {list(want)} "
                                 f"(r={rank}): is this adapter for another base model?")
            parts.setdefault((layer, module), {})[which] = tensor(key).float()
    lone = [f"layer {k[0]} {k[1]}" for k, v in parts.items() if len(v) != 2]
    if lone:
        raise ValueError(f"{file.name} holds lora_A without lora_B (or back) for {', '.join(lone)}")
    if not parts:
        raise ValueError(f"{file.name} holds no LoRA weights")
    return {k: (v["A"], v["B"]) for k, v in parts.items()}


@contextmanager
def _open_tensors(file: Path):
    """(names, name -> shape, name -> tensor) of a safetensors file (shapes read without the tensors) or of a
    PyTorch state dict, unpickled with weights_only=True (tensors and plain containers only, no code run)."""
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt") as f:
            yield list(f.keys()), lambda key: tuple(f.get_slice(key).get_shape()), f.get_tensor
        return
    import torch
    tensors = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{file.name} must hold a state dict (tensor names to tensors), got {type(tensors).__name__}")
    yield list(tensors), lambda key: tuple(tensors[key].shape), tensors.__getitem__


def _parse_key(key: str, cfg: ModelConfig) -> tuple[int, str, str]:
    m, targets = (_MULTIMODAL_KEY if cfg.language_model_only else _KEY).fullmatch(key), adapter_targets(cfg)
    if cfg.language_model_only and _TOWERS.match(key):
        raise ValueError(f"tensor {key}: LoRA on the vision tower or the multimodal projector is not supported "
                         f"(only the language model is served; target its decoder layers' {', '.join(targets)})")
    if m is None or m.group(2) not in targets:
        raise ValueError(f"tensor {key}: only LoRA on {', '.join(targets)} of the decoder layers is supported for "
                         f"model_type {cfg.model_type!r} (not the embedding, the LM head, or other modules)")
    layer = int(m.group(1))
    if layer >= cfg.num_layers:
        raise ValueError(f"tensor {key}: the base model has {cfg.num_layers} layers")
    return layer, m.group(2), m.group(3)
