"""ModelRunner's arguments checked and resolved before any weight loads (the engine and `saguaro serve` check
max_model_len with check_max_model_len too, before any Ray actor starts)."""
from __future__ import annotations

import logging

import torch

from saguaro_dist.model.device import AUTO_DTYPE, resolve_dtype
from saguaro_dist.model.hf_config import ModelConfig

log = logging.getLogger(__name__)


def check_max_model_len(max_model_len: int, cfg: ModelConfig) -> None:
    """Within the longest context the checkpoint computes exactly (hf_config.context_limit: vLLM's derived
    max_model_len, rope scaling included; a sliding window does not cap it: its layers attend over the window)."""
    if not 0 < max_model_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be in 1..{cfg.max_position_embeddings} ({cfg.context_source}), "
                         f"got {max_model_len}")


def warn_if_slow_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """float16 runs, but most CPUs have no float16 matmul kernel: torch falls back to a generic loop
    (an [8, 1024] x [1024, 1024] matmul on the 2-core CI box: 27 ms, against 0.25 ms in bfloat16)."""
    if device.type == "cpu" and dtype == torch.float16:
        log.warning("dtype float16 on the CPU: most CPUs have no float16 matmul kernel and run it up to ~100x "
                    "slower than bfloat16; use dtype bfloat16 or float32 for a model on the CPU")


def runner_dtype(path_or_hf_id, dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """dtype resolved for this checkpoint and device (model/device.py), "auto"'s choice logged, and a warning
    for one this device runs slowly."""
    try:
        resolved = resolve_dtype(dtype, cfg.hf, device)
    except ValueError as err:  # "auto" reads this checkpoint's config.json: say which one
        raise ValueError(f"{path_or_hf_id}: {err}") from None
    if dtype == AUTO_DTYPE:
        log.info("dtype auto: %s runs in %s on %s", path_or_hf_id, resolved, device)
    warn_if_slow_dtype(device, resolved)
    return resolved


def checked_batched_tokens(max_num_batched_tokens) -> int:
    """The most tokens one forward takes (an int >= 1)."""
    if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}")
    return max_num_batched_tokens
