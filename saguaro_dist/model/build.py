"""Build a model from a checkpoint directory: on the meta device first, so no parameter is ever
random-initialised; tensor parallelism (if any) is applied before the weights load, and the
projections that share an input are fused after (model/fuse.py)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from saguaro_dist.model.fuse import fuse_projections
from saguaro_dist.model.gpt_oss_weights import GptOssExpertTensors
from saguaro_dist.model.hf_config import ModelConfig
from saguaro_dist.model.layers import CausalLM
from saguaro_dist.model.loader import load_weights, read_tensor, stores_tensor
from saguaro_dist.model.phi3_config import fused_checkpoint_parts
from saguaro_dist.model.tp import apply_tensor_parallel

log = logging.getLogger(__name__)
_HEAD = "lm_head.weight"


def build_model(cfg: ModelConfig, model_dir: Path, device, dtype, tp_group=None) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.set_embed_scale(cfg.embed_scale, dtype, device)
    # A tied config whose checkpoint stores a head anyway: loaded, then tied only if equal (_tie_if_equal)
    stored_head = cfg.tie_word_embeddings and stores_tensor(model_dir, _HEAD, cfg.language_model_only)
    skip = frozenset()
    if cfg.tie_word_embeddings and not stored_head:
        model.lm_head.weight = model.model.embed_tokens.weight
        skip = frozenset({_HEAD})
    # gpt-oss's experts: stacked, interleaved, or MXFP4 dequantized to dtype (model/gpt_oss_weights.py)
    layout = (GptOssExpertTensors(lambda name: read_tensor(model_dir, name), dtype, device)
              if cfg.swiglu_limit is not None else None)
    load_weights(model, model_dir, skip, cfg.language_model_only, fused_checkpoint_parts(cfg), layout)
    if stored_head:
        _tie_if_equal(model, model_dir)
    fuse_projections(model)
    return model.eval().requires_grad_(False)


def _tie_if_equal(model: CausalLM, model_dir: Path) -> None:
    """transformers 5's tie_weights on load: a head equal to the embeddings (as loaded, in the model's dtype) is
    tied; a different one is kept and used, with a warning, config.json's tie_word_embeddings notwithstanding."""
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if head.shape == embed.shape and torch.equal(head, embed):
        model.lm_head.weight = embed
        return
    log.warning("%s: config.json sets tie_word_embeddings, but the checkpoint's %s differs from the embeddings: "
                "not tied, the stored head is used (as transformers does); set tie_word_embeddings false to "
                "silence this", model_dir, _HEAD)
