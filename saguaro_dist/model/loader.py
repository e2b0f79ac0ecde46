"""Checkpoint files: resolve a path or Hugging Face id, read *.safetensors (single or sharded), and copy
each tensor into its parameter (sharded by the parameter's module when tensor parallel)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)
_INDEX = "model.safetensors.index.json"
_METADATA_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # config, tokenizer, generation config


def resolve_model_dir(path_or_id: str | Path, weights: bool = True, revision: str | None = None) -> Path:
    """A local directory as it is; otherwise a Hugging Face id fetched into (or found in) the usual HF cache,
    at `revision` (a branch, tag or commit; None: main). weights=False fetches only the small files (config,
    tokenizer, generation config): what a driver or an API replica reads of a model whose weights load elsewhere."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision {revision!r} names a Hub revision, but {path} is a local folder")
        return path
    name = str(path_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"model path {name!r} is not a directory and not a Hugging Face id (owner/name)")
    from huggingface_hub import snapshot_download
    log.info("resolving %s%s via the Hugging Face cache%s", name, f"@{revision}" if revision else "",
             "" if weights else " (config and tokenizer only)")
    patterns = _METADATA_PATTERNS + (["*.safetensors"] if weights else [])
    return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir} (expected model.safetensors or {_INDEX})")
    return files


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str):
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r}: shape {tuple(tensor.shape)} in the checkpoint, "
                         f"the model expects {tuple(param.shape)}")
    param.copy_(tensor)


def _param_name(stored: str, wanted: set[str]) -> str:
    """The parameter a checkpoint tensor fills. A bare decoder's checkpoint (LlamaModel.save_pretrained:
    `embed_tokens.weight`, `layers.0...`, usually with a tied head) names them without the `model.`
    prefix, which transformers adds when it loads one into a causal LM; so do we."""
    return f"model.{stored}" if stored not in wanted and f"model.{stored}" in wanted else stored


def load_weights(model: nn.Module, model_dir: Path, skip: frozenset[str] = frozenset()):
    """Every parameter must come from the checkpoint (none is left as allocated); `skip` names tied ones."""
    params = {n: (m, local) for m_name, m in model.named_modules()
              for local, _ in m.named_parameters(recurse=False)
              for n in [f"{m_name}.{local}" if m_name else local]}
    wanted = set(params) - set(skip)
    loaded = set()
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                name = _param_name(stored, wanted)
                if name not in wanted:
                    continue  # e.g. rotary inv_freq buffers, or an lm_head the config ties
                module, local = params[name]
                shard = getattr(module, "shard_weight", None)  # tensor-parallel modules keep their slice
                tensor = f.get_tensor(stored) if shard is None else shard(local, f.get_slice(stored))
                with torch.no_grad():
                    _copy_into(getattr(module, local), tensor, stored)
                loaded.add(name)
    missing = sorted(wanted - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path_or_id: str | Path, revision: str | None = None):
    """The checkpoint's tokenizer via transformers.AutoTokenizer; None when the checkpoint ships none
    (such a checkpoint still loads as a model, e.g. the tiny ones the tests write)."""
    model_dir = resolve_model_dir(path_or_id, weights=False, revision=revision)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        log.info("no tokenizer files in %s", model_dir)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


# generation_config.json field -> SamplingParams field: what vLLM takes from a model's generation config
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model: str | Path, source: str = "auto", revision: str | None = None) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets (vLLM's --generation-config):
    source "auto" reads the model's own file ({} when it ships none), "vllm" none (the neutral defaults),
    anything else is a folder that must hold one. Only the fields vLLM takes, under SamplingParams' names;
    do_sample is ignored, as vLLM does."""
    if source == "vllm":
        return {}
    folder = (resolve_model_dir(model, weights=False, revision=revision) if source == "auto"
              else resolve_model_dir(source, weights=False))
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config folder {source!r} has no generation_config.json")
        return {}
    raw = json.loads(path.read_text())
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULT_FIELDS.items() if raw.get(theirs) is not None}
    if isinstance(defaults.get("top_k"), int) and defaults["top_k"] < 0:
        defaults["top_k"] = 0  # transformers' and vLLM's -1 is our 0: no top-k
    return defaults
