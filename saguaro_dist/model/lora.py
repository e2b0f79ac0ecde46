"""Multi-LoRA serving at the model layer: a table of up to max_loras adapters (model/lora_adapter.py) loaded at
once, and each forward's tokens run through their own sequence's slot (-1: the base model).

enable_lora wraps each layer's qkv_proj, o_proj, gate_up_proj and down_proj (after fusion and pretranspose) in
a LoRALinear holding every slot's weights: A [slots, in, P * R] and B [slots, R, out] (R: max_lora_rank) for a
linear fused from P projections. A slot's adapter covers it with LoRA blocks: one per projection it targets
(q / k / v, gate / up), or one over the whole fused linear (Phi-3's adapters target qkv_proj / gate_up_proj:
B as wide as q + k + v). Block i, at the adapter's rank r, has its A in columns i*r..(i+1)*r of A and its B in
rows 0..r of B at its own output columns, so a block costs only its own columns (no zero padding computed).
A forward's slot groups (LoRATokens, built on the host from each row's slot and carried by the step context as
ctx.lora) are added to the base output row by row: mid = x[rows of s] @ A_s (every block's x @ A_i in one
matmul), then y[rows, block i's columns] += mid_i @ B_i * scale_s, PEFT's order of ops per block. Rows of the
base model are never touched (bit-identical to no LoRA), and a forward with no adapted row runs no LoRA op.

Tensor parallel: a column-parallel linear (the fused q / k / v and gate / up) takes A whole and B's columns of
its rank's output (a fused block's: its q, k and v column blocks; a KV head replicated over ranks whole on each); a
row-parallel one (o, down) A over its rank's input columns, the r-wide intermediate all-reduced before B (whole),
added after the base's all-reduce and bias.
The slot groups are host data: a forward with LoRA rows has data-dependent shapes, so a model with LoRA runs
without CUDA graphs (StepGraphs refuses it, logged)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from saguaro_dist.model.hf_config import ModelConfig
from saguaro_dist.model.layers import PlainModule
from saguaro_dist.model.lora_adapter import LoRAAdapter, adapter_targets, module_shapes
from saguaro_dist.model.tp import kv_head_span

# fused linear -> the projections it holds, in its output (column) or input (row) order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class LoRATokens:
    """One forward's adapted rows: groups of (slot, flat row indices or None for every row, scale)."""
    slots: tuple[int, ...]  # each batch row's slot (-1: base), as the runner gave them
    groups: tuple


def lora_tokens(row_slots: list[int], per_row: int, scales: list[float], device) -> LoRATokens | None:
    """The groups of a [B, per_row] input whose row b runs slot row_slots[b]; None: no row is adapted."""
    used = sorted({s for s in row_slots if s >= 0})
    if not used:
        return None
    if len(used) == 1 and all(s == used[0] for s in row_slots):
        return LoRATokens(tuple(row_slots), ((used[0], None, scales[used[0]]),))
    groups = []
    for s in used:
        flat = [b * per_row + t for b, slot in enumerate(row_slots) if slot == s for t in range(per_row)]
        groups.append((s, torch.tensor(flat, dtype=torch.long, device=device), scales[s]))
    return LoRATokens(tuple(row_slots), tuple(groups))


class LoRASlots:
    """The slot table: which adapter each slot holds, its scale, and the forward now running (`active`,
    set by `selecting` around the model's forward, read by every LoRALinear)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int):
        self.cfg, self.max_loras, self.max_lora_rank = cfg, max_loras, max_lora_rank
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self.scales = [0.0] * max_loras
        self.linears: list[LoRALinear] = []
        self.active: LoRATokens | None = None

    @contextlib.contextmanager
    def selecting(self, tokens: LoRATokens | None):
        self.active = tokens
        try:
            yield
        finally:
            self.active = None

    def check_slot(self, slot: int) -> None:
        if type(slot) is not int or not 0 <= slot < self.max_loras:
            raise ValueError(f"lora slot must be an integer in 0..{self.max_loras - 1} (max_loras), got {slot!r}")

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """All layers or none: a layer that fails (a tensor of another shape, memory) leaves the slot empty,
        not half the new adapter's layers under the old one's name."""
        self.check_slot(slot)
        try:
            for linear in self.linears:
                linear.set_slot(slot, adapter)
        except Exception:
            self.evict(slot)
            raise
        self.adapters[slot], self.scales[slot] = adapter, adapter.scale

    def evict(self, slot: int) -> None:
        self.check_slot(slot)
        for linear in self.linears:
            linear.clear_slot(slot)
        self.adapters[slot], self.scales[slot] = None, 0.0


class LoRALinear(PlainModule):
    """base(x) plus the active slots' deltas on their rows (module docstring)."""

    def __init__(self, base, name: str, layer: int, table: LoRASlots, tp_group=None):
        super().__init__()
        self.base, self.name, self.parts, self.layer, self.table = base, name, FUSED[name], layer, table
        self.row_parallel = name in ROW_PARALLEL
        self.group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.rank, self.world = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if self.group else (0, 1)
        w = next(base.parameters())
        in_local, out_local = _local_in_out(base)
        self.full = module_shapes(table.cfg)
        # an adapter on the fused module (Phi-3) is one LoRA; one on its parts needs an A per part
        blocks = 1 if name in adapter_targets(table.cfg) else len(self.parts)
        big_r = table.max_lora_rank
        self.register_buffer("a", torch.zeros(table.max_loras, in_local, blocks * big_r, dtype=w.dtype,
                                              device=w.device))
        self.register_buffer("b", torch.zeros(table.max_loras, big_r, out_local, dtype=w.dtype, device=w.device))
        self.spans: list[tuple[int, tuple] | None] = [None] * table.max_loras  # per slot: (rank, output spans)
        self.start, col = {}, 0  # each part's first column in this rank's output
        for part in self.parts:
            self.start[part], col = col, col + self._local_out(part)

    def _local_out(self, part: str) -> int:
        lo, hi = self._rows(part)
        return hi - lo

    def _rows(self, part: str) -> tuple[int, int]:
        """The rows of the part's whole output this rank computes: all (row parallel), its KV heads' (k / v: a
        head replicated when fewer than the ranks, model/tp.py), else its 1/world share."""
        out = self.full[part][0]
        if self.row_parallel:
            return 0, out
        if part in ("k_proj", "v_proj"):
            cfg = self.table.cfg
            return tuple(h * cfg.head_dim for h in kv_head_span(cfg.num_kv_heads, self.rank, self.world))
        return self.rank * out // self.world, (self.rank + 1) * out // self.world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        tokens = self.table.active
        return y if tokens is None else self._add_deltas(x, y, tokens.groups)

    def _add_deltas(self, x, y, groups):
        """Per slot: mid = x @ [A_1 | A_2 ...] (every block's x @ A_i in one matmul), then each block's
        mid_i @ B_i * scale added to its own output columns only."""
        flat, out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows, scale in groups:
            r, spans = self.spans[slot]
            if not spans:  # this layer is not adapted by that slot's adapter (the same on every rank)
                continue
            mid = (flat if rows is None else flat.index_select(0, rows)) @ self.a[slot, :, :len(spans) * r]
            if self.group is not None and self.row_parallel:  # partial sums over this rank's input columns
                dist.all_reduce(mid, group=self.group)
            for i, (lo, hi) in enumerate(spans):
                delta = mid[:, i * r:(i + 1) * r] @ self.b[slot, :r, lo:hi] * scale
                if rows is None:
                    out[:, lo:hi] += delta
                else:
                    out[:, lo:hi].index_add_(0, rows, delta)
        return y

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.spans[slot] = None

    def set_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """This rank's share of each block the adapter adapts here, packed at its rank: block i's A in columns
        i*r..(i+1)*r of a, its B in rows 0..r of b at its own output columns."""
        self.clear_slot(slot)
        r, spans = adapter.rank, []
        for i, (parts, a, b) in enumerate(self._blocks(adapter)):
            lo = self.start[parts[0]]
            hi = lo + sum(self._local_out(p) for p in parts)
            if self.row_parallel:
                width = self.full[parts[0]][1] // self.world
                a = a[:, self.rank * width:(self.rank + 1) * width]
            else:
                b = self._local_rows(b, parts)
            self.a[slot, :, i * r:(i + 1) * r] = a.t().to(self.a.dtype)
            self.b[slot, :r, lo:hi] = b.t().to(self.b.dtype)
            spans.append((lo, hi))
        self.spans[slot] = (r, tuple(spans))

    def _blocks(self, adapter: LoRAAdapter) -> list[tuple[tuple[str, ...], torch.Tensor, torch.Tensor]]:
        """(the parts a LoRA covers, A, B) for each LoRA of this layer's linear: the fused one, or each part's."""
        fused = adapter.weights.get((self.layer, self.name))
        if fused is not None:
            return [(self.parts, *fused)]
        found = [(part, adapter.weights.get((self.layer, part))) for part in self.parts]
        return [((part, ), *ab) for part, ab in found if ab is not None]

    def _local_rows(self, b: torch.Tensor, parts: tuple[str, ...]) -> torch.Tensor:
        """B's rows this rank computes: its column block of each part (q, k and v each split across ranks)."""
        blocks, first = [], 0
        for part in parts:
            lo, hi = self._rows(part)
            blocks.append(b[first + lo:first + hi])
            first += self.full[part][0]
        return torch.cat(blocks)


def _local_in_out(base) -> tuple[int, int]:
    """(in, out) of this rank's linear: nn.Linear, a pretransposed one, or a tensor-parallel one."""
    if hasattr(base, "weight_t"):
        return tuple(base.weight_t.shape)
    return base.weight.shape[1], base.weight.shape[0]


def enable_lora(model, cfg: ModelConfig, max_loras: int, max_lora_rank: int, tp_group=None) -> LoRASlots:
    """Wrap the built (fused, pretransposed) model's projections; model.lora_slots is the table."""
    from saguaro_dist.model.moe import has_experts
    if has_experts(model):
        raise ValueError("LoRA is not supported on mixture-of-experts models (their experts' MLPs); "
                         "run this model with max_loras 0")
    table = LoRASlots(cfg, max_loras, max_lora_rank)
    for i, layer in enumerate(model.model.layers):
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            wrapped = LoRALinear(getattr(owner, name), name, i, table, tp_group)
            setattr(owner, name, wrapped)
            table.linears.append(wrapped)
    model.lora_slots = table
    return table


def has_lora(model) -> bool:
    return getattr(model, "lora_slots", None) is not None
