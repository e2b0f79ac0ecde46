"""Device and dtype helpers."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTO_DTYPE = "auto"  # vLLM's --dtype auto: resolved per checkpoint and device (auto_dtype)
BF16_MIN_CAPABILITY = (8, 0)  # vLLM's floor (platforms/cuda.py): Pascal, Volta and Turing GPUs lack bfloat16


@dataclass(frozen=True)
class DeviceKind:
    """What the dtype rules need to know of a device, as plain data: they stay pure (and testable without a GPU)."""
    type: str                                  # "cpu" or "cuda"
    capability: tuple[int, int] | None = None  # a CUDA GPU's compute capability; None: not known (taken as capable)
    name: str = ""                             # the GPU's name, for messages

    @property
    def has_bf16(self) -> bool:
        return self.type != "cuda" or self.capability is None or tuple(self.capability) >= BF16_MIN_CAPABILITY

    def describe(self) -> str:
        major, minor = self.capability or (0, 0)
        return f"{self.name or self.type!r} (compute capability {major}.{minor})"


# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS of the families we run, and gpt-oss (vLLM's MXFP4 path takes bf16 only:
# its activations pass float16's range in the later layers of 120b)
FLOAT16_UNSTABLE = ("gemma2", "gemma3", "gemma3_text", "gpt_oss")

def device_kind(device) -> DeviceKind:
    """The DeviceKind of `device`, a torch device or its name; a GPU this process cannot see is left unknown
    (resolve_device refuses it where the model loads)."""
    if isinstance(device, DeviceKind):
        return device
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return DeviceKind(dev.type)
    return DeviceKind("cuda", tuple(torch.cuda.get_device_capability(dev)), torch.cuda.get_device_name(dev))


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
    """dtype "auto" for a checkpoint (its config.json as a dict) on `device` (a torch device, its name or a
    DeviceKind). On CUDA, vLLM's rule: FP16 for FP32 and FP16 checkpoints, BF16 for BF16 ones (16-bit runs
    on the tensor cores, in half the memory), FP16 for those too on a GPU without bfloat16, with a warning
    (vLLM's _resolve_auto_dtype falls back so). On the CPU float32 stays float32: it is the checkpoint's own
    precision, unrounded, and every CPU has fast float32 kernels while bfloat16 ones need AVX512-BF16 or AMX;
    float16 becomes bfloat16, as vLLM's CPU backend does: CPUs have no float16 matmul kernel
    (warn_if_slow_dtype), and bfloat16 keeps the checkpoint's memory and float16's range."""
    saved, kind = checkpoint_dtype(hf), device_kind(device)
    if kind.type != "cuda":
        return "bfloat16" if saved == "float16" else saved
    if saved == "bfloat16" and not kind.has_bf16:
        log.warning("dtype auto: your GPU %s does not support bfloat16 (compute capability %d.%d or later needs "
                    "it); falling back to float16 for this bfloat16 checkpoint", kind.describe(), *BF16_MIN_CAPABILITY)
        return "float16"
    return "float16" if saved == "float32" else saved


def check_dtype_supported(dtype: torch.dtype, device) -> None:
    """A dtype the device computes in, else vLLM's error: bfloat16 on a GPU older than Ampere."""
    kind = device_kind(device)
    if dtype == torch.bfloat16 and not kind.has_bf16:
        major, minor = BF16_MIN_CAPABILITY
        raise ValueError(f"bfloat16 is only supported on GPUs with compute capability of at least {major}.{minor}; "
                         f"your GPU {kind.describe()} lacks it. Use dtype float16 instead (--dtype float16), "
                         f"or dtype auto, which falls back to float16 there")


def resolve_dtype(dtype, hf: dict, device) -> torch.dtype:
    """parse_dtype, with "auto" resolved for this checkpoint on this device (auto_dtype, then float16_stable),
    checked against what the device supports (check_dtype_supported) and the model (check_float16_stable)."""
    kind = device_kind(device)
    if dtype == AUTO_DTYPE:
        dtype = float16_stable(auto_dtype(hf, kind), hf, kind)
    resolved = parse_dtype(dtype)
    check_dtype_supported(resolved, kind)
    check_float16_stable(resolved, hf)
    return resolved


def float16_stable(dtype: str, hf: dict, kind: DeviceKind) -> str:
    """auto's float16 for a model whose activations overflow it: bfloat16 where the device has it, else
    float32 (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS rule)."""
    if dtype != "float16" or hf.get("model_type") not in FLOAT16_UNSTABLE:
        return dtype
    return "bfloat16" if kind.has_bf16 else "float32"


def check_float16_stable(dtype: torch.dtype, hf: dict) -> None:
    if dtype == torch.float16 and hf.get("model_type") in FLOAT16_UNSTABLE:
        raise ValueError(f"float16 is not supported for {hf['model_type']} models: their activations overflow "
                         f"float16 (vLLM refuses it too); use bfloat16, float32 or auto")


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
