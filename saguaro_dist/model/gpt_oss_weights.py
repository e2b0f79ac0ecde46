"""gpt-oss's expert tensors onto our per-expert parameters (moe.GptOssMoeBlock: mlp.experts.E.gate_proj / up_proj /
down_proj, weights and biases). Checkpoints stack each layer's experts as transformers 5.25's GptOssExperts keeps
them: gate_up_proj [E, hidden, 2 x width] with gate and up INTERLEAVED (even columns the gate, odd the up),
gate_up_proj_bias [E, 2 x width] likewise, down_proj [E, width, hidden], down_proj_bias [E, hidden]; the Hub's
store the two weights in MXFP4 instead (gate_up_proj_blocks / _scales, rows the output features: model/mxfp4.py).
Each expert is read (and dequantized) only when its parameter loads, one at a time: a layer's 128 experts are
never all in memory at once, in the model's dtype."""
from __future__ import annotations

import re
from typing import Callable

import torch

from saguaro_dist.model.mxfp4 import check_packed, dequantize

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_HALVES = (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))  # gate_up's interleaved rows


class _ExpertSlice:
    """One expert's tensor in nn.Linear's layout, made (read, transposed, dequantized) on first indexing and kept
    for its gate / up halves: read as a safetensors slice is (get_shape, indexing), so tensor parallel reads it."""

    def __init__(self, shape: list[int], make: Callable[[], torch.Tensor], rows=slice(None)):
        self.shape, self.make, self.rows = shape, make, rows

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.make()[self.rows][index]


class _Memo:
    """make() once for `uses` reads: an expert's gate and up halves share one read (and dequantization) of
    gate_up, dropped after the last, so only the expert loading now is held."""

    def __init__(self, make: Callable[[], torch.Tensor], uses: int):
        self._make, self._made, self._left = make, None, uses

    def __call__(self) -> torch.Tensor:
        made = self._make() if self._made is None else self._made
        self._left -= 1
        self._made = made if self._left > 0 else None
        return made


class GptOssExpertTensors:
    """The loader's layout hook for gpt-oss (loader.load_weights' `layout`): (stored name, slice) -> our
    (parameter, slice) pairs, or None for a tensor not its experts'. read_tensor(name): a checkpoint tensor
    whole, or None (an MXFP4 weight's scales, which may sit in another shard)."""

    def __init__(self, read_tensor: Callable[[str], torch.Tensor | None], dtype: torch.dtype, device):
        self.read_tensor, self.dtype, self.device = read_tensor, dtype, device

    def __call__(self, name: str, sl) -> list[tuple[str, object]] | None:
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return None
        prefix, proj, kind = m[1], m[2], m[3] or ""
        if kind == "_scales":
            return []  # read with its blocks
        uses = 1 if proj == "down_proj" else len(_HALVES)
        experts = (self._blocks(name, f"{prefix}.{proj}_scales", sl, uses) if kind == "_blocks"
                   else _stacked(sl, kind, uses))
        local = "bias" if kind == "_bias" else "weight"
        if proj == "down_proj":
            return [(f"{prefix}.{e}.down_proj.{local}", part) for e, part in enumerate(experts)]
        return [(f"{prefix}.{e}.{half}.{local}", _ExpertSlice([part.shape[0] // 2, *part.shape[1:]], part.make, rows))
                for e, part in enumerate(experts) for half, rows in _HALVES]

    def _blocks(self, name: str, scales_name: str, sl, uses: int) -> list[_ExpertSlice]:
        """An MXFP4 weight [E, rows, G, 16] (+ its scales [E, rows, G]): each expert's [rows, G * 32] in dtype."""
        scales = self.read_tensor(scales_name)
        if scales is None:
            raise ValueError(f"checkpoint tensor {name!r} (MXFP4) has no {scales_name!r} beside it")
        shape = sl.get_shape()
        check_packed(name, shape[1:], scales.shape[1:])
        if shape[0] != scales.shape[0]:
            raise ValueError(f"MXFP4 tensor {name!r}: {shape[0]} experts' blocks, {scales.shape[0]} experts' scales")

        def expert(e: int) -> torch.Tensor:
            return dequantize(sl[e].to(self.device), scales[e].to(self.device), self.dtype)
        return [_ExpertSlice([shape[1], shape[2] * 32], _Memo(lambda e=e: expert(e), uses)) for e in range(shape[0])]


def _stacked(sl, kind: str, uses: int) -> list[_ExpertSlice]:
    """transformers' stacked tensor: weights [E, in, out] (each expert's transposed to [out, in]), biases [E, out]."""
    shape = sl.get_shape()
    if kind == "_bias":
        return [_ExpertSlice(shape[1:], _Memo(lambda e=e: sl[e], uses)) for e in range(shape[0])]
    return [_ExpertSlice([shape[2], shape[1]], _Memo(lambda e=e: sl[e].T, uses)) for e in range(shape[0])]
