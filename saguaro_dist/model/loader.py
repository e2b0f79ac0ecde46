"""Checkpoint files: resolve a path or Hugging Face id, read *.safetensors (single or sharded) or, when a
checkpoint ships none, pytorch_model*.bin (torch.load, weights_only), and copy each tensor into its
parameter (sharded by the parameter's module when tensor parallel)."""
from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from saguaro_dist.model.fp8 import FP8_METHODS, Fp8Weights, fp8_scheme

log = logging.getLogger(__name__)
_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_METADATA_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # config, tokenizer, generation config
_BIN_PATTERN = "pytorch_model*.bin"  # not *.bin: repos also hold training_args.bin and optimizer states
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; rebuilt from config.json


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
    log.info("resolving %s%s via the Hugging Face cache%s", name, f"@{revision}" if revision else "",
             "" if weights else " (config and tokenizer only)")
    folder = _hub_snapshot(name, revision, _METADATA_PATTERNS)
    if not weights:
        return folder
    folder = _hub_snapshot(name, revision, _weight_patterns(folder, _INDEX, "*.safetensors"))
    if not any(folder.glob("*.safetensors")):  # an older checkpoint: PyTorch pickles only
        folder = _hub_snapshot(name, revision, _weight_patterns(folder, _BIN_INDEX, _BIN_PATTERN))
    return folder


def _weight_patterns(folder: Path, index: str, pattern: str) -> list[str]:
    """The weight files to fetch: the shards the index names, else every file of the pattern. Not every
    *.safetensors beside an index: Mistral's repos also hold consolidated.safetensors, the same weights
    in Mistral's own layout (twice the download, and none of it read)."""
    return _index_shards(folder / index) if (folder / index).is_file() else [pattern]


def _index_shards(index: Path) -> list[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _hub_snapshot(name: str, revision: str | None, patterns: list[str]) -> Path:
    """snapshot_download, its failures (every one an OSError: not in the offline cache, no such repo or
    revision, gated, no network) made one ValueError that names the id and what to do."""
    from huggingface_hub import constants, snapshot_download
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except OSError as err:
        raise ValueError(hub_failure(name, revision, err, bool(constants.HF_HUB_OFFLINE))) from None


def hub_failure(name: str, revision: str | None, err: Exception, offline: bool) -> str:
    """Why a Hub id could not be resolved, and what to do, in one message (not the HTTP client's stack)."""
    at = f"{name!r}" + (f" at revision {revision!r}" if revision else "")
    reason = (str(err).strip().splitlines() or [""])[0]
    if offline:
        hint = ("HF_HUB_OFFLINE is set, so only the local Hugging Face cache is read, and it does not hold this "
                f"model (at this revision): download it where the Hub can be reached (hf download {name}), unset "
                "HF_HUB_OFFLINE, or pass a local folder")
    else:
        hint = ("Check the id and revision, the network, and HF_TOKEN for a gated or private repository; "
                "without a network, set HF_HUB_OFFLINE=1 to read a model already in the cache, or pass a local folder")
    return (f"model {at} is not a local folder, and the Hugging Face Hub could not provide it "
            f"({type(err).__name__}: {reason}). {hint}")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """Safetensors when the checkpoint has them (an index's shards, model.safetensors, or every file),
    else the PyTorch pickles, by the same rule."""
    return list(_checkpoint_layout(model_dir)[0].values())


def _checkpoint_layout(model_dir: Path) -> tuple[dict[str, Path], dict[str, str] | None]:
    """checkpoint_files by their names, and each tensor's file's name when an index names them (None without one):
    the index read once."""
    for index, single, pattern in ((_INDEX, "model.safetensors", "*.safetensors"),
                                   (_BIN_INDEX, "pytorch_model.bin", _BIN_PATTERN)):
        if (model_dir / index).is_file():
            weight_map = json.loads((model_dir / index).read_text())["weight_map"]
            shards = {s: model_dir / s for s in sorted(set(weight_map.values()))}  # one Path a shard, not a tensor
            missing = [s for s, file in shards.items() if not file.is_file()]
            if missing:
                raise ValueError(f"{model_dir / index} names shard files that do not exist: {missing}")
            return shards, weight_map
        if (model_dir / single).is_file():
            return {single: model_dir / single}, None
        if files := sorted(model_dir.glob(pattern)):
            return {file.name: file for file in files}, None
    raise ValueError(f"no *.safetensors weights in {model_dir} (expected model.safetensors or {_INDEX}; "
                     f"or pytorch_model.bin or {_BIN_INDEX})")


class _TensorSlice:
    """A loaded tensor read as a safetensors slice is (get_shape, indexing): what tensor parallel reads."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _pickled_state(file: Path) -> dict:
    """A pytorch_model*.bin state dict, memory-mapped; weights_only: a pickle runs no code of its own."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{file} is not a plain state dict of tensors (torch.load weights_only): {err}") from None
    except RuntimeError:  # the pre-1.6 (non-zip) format cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True)


def _tensor_slices(file: Path):
    """(stored name, slice) of every tensor in a weights file; slice[:] reads it whole."""
    if file.suffix != ".bin":
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
        return
    for name, tensor in _pickled_state(file).items():
        yield name, _TensorSlice(tensor)


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


# A multimodal checkpoint's language model under the names transformers writes (5.x: language_model.model.*,
# 4.52-4.57: model.language_model.*), and the towers it also holds, which a text-only runtime never reads
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
_OTHER_TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                         "model.multi_modal_projector.")


def language_model_name(stored: str) -> str | None:
    """A multimodal checkpoint's tensor under its language model's causal-LM name; None for the vision
    tower's and the projector's (skipped); any other name as it is (then a tensor left over, refused)."""
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return ours + stored[len(prefix):]
    return None if stored.startswith(_OTHER_TOWER_PREFIXES) else stored


# Mixtral's Hub names for its experts' projections -> ours (the Qwen3-MoE Hub names); its block_sparse_moe is our mlp
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.\d+)\.(w[123])\.weight")
# transformers 5's in-memory layout (save_pretrained(save_original_format=False) writes it): each layer's experts
# stacked, gate_up_proj [E, 2 x width, hidden] (gate rows first), down_proj [E, hidden, width]
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


def expert_tensors(stored: str, sl) -> list[tuple[str, object]]:
    """(parameter name, slice) pairs a checkpoint tensor fills: MoE experts' under our per-expert names,
    whichever layout wrote them (Mixtral's Hub w1 / w2 / w3, Qwen3-MoE's Hub names, transformers' stacked
    tensors); any other tensor as it is."""
    if "experts" not in stored and "block_sparse_moe" not in stored:
        return [(stored, sl)]
    name = stored.replace(".block_sparse_moe.", ".mlp.")
    if m := _MIXTRAL_EXPERT.fullmatch(name):
        return [(f"{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.weight", sl)]
    if not (m := _FUSED_EXPERTS.fullmatch(name)):
        return [(name, sl)]
    stacked = sl[:]
    parts = (("down_proj", stacked),) if m[2] == "down_proj" else zip(("gate_proj", "up_proj"), stacked.chunk(2, 1))
    return [(f"{m[1]}.{e}.{proj}.weight", _TensorSlice(t[e])) for proj, t in parts for e in range(len(t))]


def fused_tensors(stored: str, sl, fused: dict) -> list[tuple[str, object]]:
    """(parameter name, slice) pairs of a checkpoint tensor that stacks several of our projections by rows
    (Phi-3's qkv_proj, gate_up_proj: `fused`, phi3_config.fused_checkpoint_parts), each part whole: a tensor
    parallel rank then reads its own heads' (width's) rows of each part. Any other tensor as it is."""
    module, _, local = stored.rpartition(".")
    parent, _, fused_name = module.rpartition(".")
    parts = fused.get(f"{parent.rpartition('.')[2]}.{fused_name}")
    if parts is None or local != "weight":
        return [(stored, sl)]
    rows = sl.get_shape()[0]
    if rows != sum(size for _, size in parts):
        raise ValueError(f"tensor {stored!r}: {rows} rows in the checkpoint, the model expects "
                         f"{' + '.join(f'{name} {size}' for name, size in parts)}")
    split = sl[:].split([size for _, size in parts])
    return [(f"{parent}.{name}.weight", _TensorSlice(t)) for (name, _), t in zip(parts, split)]


def _parameter_parts(name: str, sl, fused: dict, layout=None) -> list[tuple[str, object]]:
    """Every (parameter name, slice) a checkpoint tensor fills: a family's own layout's (gpt-oss's experts), else
    fused rows split, MoE experts renamed."""
    own = None if layout is None else layout(name, sl)
    if own is not None:
        return own
    return [pair for param, part in fused_tensors(name, sl, fused) for pair in expert_tensors(param, part)]


def load_weights(model: nn.Module, model_dir: Path, skip: frozenset[str] = frozenset(),
                 language_model_only: bool = False, fused: dict | None = None, layout=None):
    """language_model_only: the checkpoint is multimodal (Gemma 3 4B-27B), its language model is loaded
    (language_model_name). fused: tensors stacking several parameters (fused_tensors; None: none). layout: a
    family's own tensors, (name, slice) -> (parameter, slice) pairs or None (gpt_oss_weights). Every
    parameter must come from the checkpoint (none is left as allocated), and every tensor of the checkpoint must fill one (but buffers and `skip`: tied ones): a tensor left over means config.json
    does not describe these weights (attention biases it omits, more layers), and dropping it computed
    another model than the checkpoint's, silently (vLLM refuses such a checkpoint too)."""
    params = {n: (m, local) for m_name, m in model.named_modules()
              for local, _ in m.named_parameters(recurse=False)
              for n in [f"{m_name}.{local}" if m_name else local]}
    wanted = set(params) - set(skip)
    loaded, unexpected = set(), []
    fp8 = _fp8_weights(model, model_dir)
    for file in checkpoint_files(model_dir):
        for stored, sl in _tensor_slices(file):
            name = language_model_name(stored) if language_model_only else stored
            if name is None or (fp8 is not None and (sl := fp8(stored, sl)) is None):
                continue  # another tower's tensor, or an FP8 scale (read with its weight, or unused)
            for param, part in _parameter_parts(name, sl, fused or {}, layout):
                param = _param_name(param, wanted)
                if param not in wanted:
                    if param not in skip and not param.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(stored)
                    continue
                _load_tensor(*params[param], part, stored)
                loaded.add(param)
    _check_complete(model_dir, sorted(wanted - loaded), unexpected)
    if fp8 is not None:
        fp8.finish(model_dir)


def _fp8_weights(model: nn.Module, model_dir: Path) -> Fp8Weights | None:
    """An FP8 checkpoint's hook (config.json's quantization_config: model/fp8.py), its float8 weights dequantized
    to the model's dtype on its device as they load; None for any other checkpoint."""
    config = model_dir / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    quant = hf.get("quantization_config")
    if not (isinstance(quant, dict) and quant.get("quant_method") in FP8_METHODS):
        return None
    param, tensors = next(model.parameters()), CheckpointTensors(model_dir)
    return Fp8Weights(fp8_scheme(hf), tensors, tensors.read, param.dtype, param.device)


def stores_tensor(model_dir: Path, name: str, language_model_only: bool = False) -> bool:
    """Whether the checkpoint holds a tensor that fills parameter `name` (a multimodal one's under its language
    model's name, as load_weights reads it); only the index or the files' headers are read."""
    stored = CheckpointTensors(model_dir)._where()
    return any((language_model_name(s) if language_model_only else s) == name for s in stored)


def read_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """One checkpoint tensor by its stored name, whole (from the shard the index names, if any); None if absent.
    It reads the index (or every file's names) each call: to read many, keep one CheckpointTensors."""
    return CheckpointTensors(model_dir).read(name)


class CheckpointTensors:
    """A checkpoint's tensors by stored name, for reading many of them (an FP8 checkpoint's scales): the index
    read once, or without one each file's names once (the first file holding a name has it, as a scan in order
    finds); each file opened at most once and kept open (its header parsed once) while this object lives."""

    def __init__(self, model_dir: Path):
        self._files, self._file_of = _checkpoint_layout(model_dir)  # file name -> file; tensor -> its file's name
        self._opened: dict[str, tuple[object, set[str]]] = {}  # file name -> (safe_open handle or state dict, names)

    def __contains__(self, name: str) -> bool:
        file = self._where().get(name)
        return file is not None and name in self._open(file)[1]

    def read(self, name: str) -> torch.Tensor | None:
        """The tensor whole; None if absent (an index may name a tensor its shard lacks)."""
        if name not in self:
            return None
        source, _ = self._open(self._file_of[name])
        return source[name] if isinstance(source, dict) else source.get_tensor(name)

    def _where(self) -> dict[str, str]:
        if self._file_of is None:
            self._file_of = {}
            for file in self._files:
                for name in self._open(file)[1]:
                    self._file_of.setdefault(name, file)
        return self._file_of

    def _open(self, file: str) -> tuple[object, set[str]]:
        if file not in self._opened:
            path = self._files[file]
            source = _pickled_state(path) if path.suffix == ".bin" else safe_open(str(path), framework="pt")
            self._opened[file] = source, set(source.keys())
        return self._opened[file]


def _load_tensor(module: nn.Module, local: str, sl, stored: str) -> None:
    shard = getattr(module, "shard_weight", None)  # tensor-parallel modules keep their slice
    with torch.no_grad():
        _copy_into(getattr(module, local), sl[:] if shard is None else shard(local, sl), stored)


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")


def _check_complete(model_dir: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensor(s): {_names(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} holds tensor(s) the model its config.json describes has no "
                         f"place for: {_names(sorted(unexpected))}; config.json does not match these weights "
                         "(attention_bias, num_hidden_layers, tie_word_embeddings, model_type?)")


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
