"""Device and dtype helpers."""
from __future__ import annotations

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
