"""Device and dtype helpers."""
from __future__ import annotations

import contextlib

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTO_DTYPE = "auto"  # vLLM's --dtype auto: resolved per checkpoint and device (auto_dtype)


def set_torch_threads(n: int | None):
    """Intra-op threads for this process (None leaves torch's default)."""
    if n is not None:
        torch.set_num_threads(int(n))


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]


def checkpoint_dtype(hf: dict) -> str:
    """The dtype a checkpoint's config.json says its weights are: `dtype` (transformers >= 4.56 writes
    it) or `torch_dtype`; float32 when it says none, as transformers and vLLM read it."""
    saved = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    name = str(saved).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype auto: config.json says the weights are {saved!r}, not one of "
                         f"{', '.join(_DTYPES)}; name the dtype instead")
    return name


def auto_dtype(hf: dict, device) -> str:
    """dtype "auto" for a checkpoint (its config.json as a dict) on `device`. On CUDA, vLLM's rule: FP16
    for FP32 and FP16 checkpoints, BF16 for BF16 ones (16-bit runs on the tensor cores, in half the
    memory). On the CPU float32 stays float32: it is the checkpoint's own precision, unrounded, and every
    CPU has fast float32 kernels while bfloat16 ones need AVX512-BF16 or AMX; float16 becomes bfloat16,
    as vLLM's CPU backend does: CPUs have no float16 matmul kernel (warn_if_slow_dtype), and bfloat16
    keeps the checkpoint's memory and float16's range."""
    saved = checkpoint_dtype(hf)
    if torch.device(device).type == "cuda":
        return "float16" if saved == "float32" else saved
    return "bfloat16" if saved == "float16" else saved


def resolve_dtype(dtype, hf: dict, device) -> torch.dtype:
    """parse_dtype, with "auto" resolved for this checkpoint on this device (auto_dtype)."""
    return parse_dtype(auto_dtype(hf, device) if dtype == AUTO_DTYPE else dtype)


def resolve_device(device) -> torch.device:
    """torch.device(device), or a ValueError saying why this process cannot use it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA GPU "
                             "(a CPU build, or no GPU visible to this process)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev


class OwnStream:
    """One thread's GPU work on a CUDA stream of its own (a no-op off CUDA). On the default stream a
    draft thread's kernels queue behind the target's; on its own stream they can run beside them on
    the same GPU, which is what SSD's overlap of tree building and verification needs there."""

    def __init__(self, device):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:  # the model and KV written so far (on the builder's stream) come first
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def __call__(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
