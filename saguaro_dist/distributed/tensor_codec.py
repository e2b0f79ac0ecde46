"""torch tensors and numpy arrays as saguaro.v1 Tensor messages: C-order, little-endian bytes, every
element bit for bit. Decoding checks the stated shape against the bytes and raises CodecError."""
from __future__ import annotations

import numpy as np
import torch

from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.distributed.wire_checks import CodecError

__all__ = ["WIRE_DTYPES", "TORCH_DTYPES", "INT32", "little_endian", "host_array", "tensor_to_proto",
           "tensor_from_proto", "array_to_proto", "array_from_proto", "integer_array"]

_DT = pb.Tensor.DType
WIRE_DTYPES = {
    torch.float32: _DT.FLOAT32, torch.float16: _DT.FLOAT16, torch.bfloat16: _DT.BFLOAT16,
    torch.float64: _DT.FLOAT64, torch.int64: _DT.INT64, torch.int32: _DT.INT32, torch.int16: _DT.INT16,
    torch.int8: _DT.INT8, torch.uint8: _DT.UINT8, torch.bool: _DT.BOOL,
}
TORCH_DTYPES = {v: k for k, v in WIRE_DTYPES.items()}
INT32 = _DT.INT32
_ITEMSIZE = {d: d.itemsize for d in WIRE_DTYPES}
# A stated shape's bounds: a message (under 2 GiB) carries fewer elements; numpy takes up to 64 dimensions.
MAX_NDIM, MAX_EXTENT = 16, 1 << 32
# Bytes move through numpy: a torch op costs ~10 us here, a numpy call ~1 us, and a tree is dozens of
# small tensors. numpy has no bfloat16: its elements travel as their int16 bits.
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16, torch.float64: np.float64,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.bool: np.bool_}


def little_endian(arr: np.ndarray) -> np.ndarray:
    """arr with little-endian elements: the wire's byte order (a no-op on little-endian hosts)."""
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def host_array(t: torch.Tensor) -> np.ndarray:
    """t's elements as a numpy array in host memory (bfloat16 as its int16 bits; strides kept)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    dtype = WIRE_DTYPES.get(t.dtype)
    if dtype is None:
        raise CodecError(f"tensor dtype {t.dtype} has no wire form")
    return array_to_proto(host_array(t), dtype)


def array_to_proto(arr: np.ndarray, dtype) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), data=little_endian(arr).tobytes())  # C order


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"tensor dtype {msg.dtype} is not supported")
    t = torch.from_numpy(array_from_proto(msg, dtype))
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t


def array_from_proto(msg: pb.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A private, writable, native-order copy of the message's elements, shaped."""
    shape = list(msg.shape)
    numel = _checked_numel(shape)
    if len(msg.data) != numel * _ITEMSIZE[dtype]:
        raise CodecError(f"tensor of shape {shape} and dtype {dtype} needs {numel * _ITEMSIZE[dtype]} bytes, "
                         f"got {len(msg.data)}")
    wire = np.dtype(_NUMPY[dtype]).newbyteorder("<")
    return np.frombuffer(msg.data, dtype=wire).astype(wire.newbyteorder("="), copy=True).reshape(shape)


def _checked_numel(shape: list[int]) -> int:
    """The element count of a stated shape, every dimension bounded: a zero-size tensor passes the byte count
    whatever its other dimensions, and numpy's reshape refused a huge one with a plain ValueError (not a
    CodecError: it failed the whole stream, not the one batch)."""
    if len(shape) > MAX_NDIM:
        raise CodecError(f"tensor has {len(shape)} dimensions, over {MAX_NDIM}")
    extent = 1  # the element count with its zero dimensions taken as one
    for d in shape:
        if d < 0:
            raise CodecError(f"tensor shape {shape} has a negative dimension")
        extent *= max(d, 1)
        if extent > MAX_EXTENT:
            raise CodecError(f"tensor shape {shape} spans over {MAX_EXTENT} elements (zero dimensions as one)")
    return 0 if 0 in shape else extent


def integer_array(msg: pb.Tensor, what: str) -> np.ndarray:
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None or dtype.is_floating_point or dtype == torch.bool:
        raise CodecError(f"{what} must be an integer tensor, got dtype {dtype or msg.dtype}")
    return array_from_proto(msg, dtype)
