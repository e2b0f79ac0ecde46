"""Device and dtype helpers."""
from __future__ import annotations

import contextlib

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
