"""Tensor parallelism applied to a built (meta) model: linears and the vocabulary are split across the ranks
of a torch.distributed group, each rank reading only its slice of every tensor as the weights load."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from saguaro_dist.model.layers import PlainModule, ProjectionNormAttention, RMSNorm, WeightFirstRMSNorm
from saguaro_dist.model.moe import SparseMoeBlock


def _span(full: int, rank: int, world: int) -> tuple[int, int]:
    size = -(-full // world)  # ceil: the last rank's slice may be short (vocab) and is zero-padded
    return min(rank * size, full), min((rank + 1) * size, full)


def _read(sl, dim: int, lo: int, hi: int, size: int) -> torch.Tensor:
    """Rows/columns lo..hi of a safetensors slice along `dim`, zero-padded to `size`."""
    t = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
    if t.shape[dim] < size:
        pad = list(t.shape)
        pad[dim] = size - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    return t


class _Sharded(PlainModule):
    """Mixin: which dim of the full tensor this rank keeps (None: replicated), and how to read it. A
    PlainModule: called straight into forward."""
    split = {}  # local param name -> dim

    def _join(self, group):
        self.rank, self.world, self.group = dist.get_rank(group), dist.get_world_size(group), group

    def shard_weight(self, local: str, sl) -> torch.Tensor:
        dim = self.split.get(local)
        if dim is None:
            return sl[:]
        full = sl.get_shape()[dim]
        lo, hi = _span(full, self.rank, self.world)
        return _read(sl, dim, lo, hi, -(-full // self.world))


class ColumnParallelLinear(_Sharded, nn.Linear):
    """Output features split; the output stays split (feeds a head-split attention or a row-parallel linear)."""
    split = {"weight": 0, "bias": 0}

    def __init__(self, base: nn.Linear, group):
        world = dist.get_world_size(group)
        super().__init__(base.in_features, base.out_features // world, bias=base.bias is not None, device="meta")
        self._join(group)


def kv_head_span(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """The KV heads a rank keeps: its 1/world share; with fewer KV heads than ranks (vLLM's num_kv_head_replicas),
    the one head its query heads read, replicated on world / num_kv_heads consecutive ranks."""
    if num_kv_heads >= world:
        per = num_kv_heads // world
        return rank * per, (rank + 1) * per
    head = rank // (world // num_kv_heads)
    return head, head + 1


class KVParallelLinear(_Sharded, nn.Linear):
    """k / v projection: the rows of this rank's KV heads (kv_head_span), a head replicated when there are fewer
    KV heads than ranks. Its output feeds this rank's attention only, as a column-parallel one's."""

    def __init__(self, base: nn.Linear, group, num_kv_heads: int):
        head_dim = base.out_features // num_kv_heads
        lo, hi = kv_head_span(num_kv_heads, dist.get_rank(group), dist.get_world_size(group))
        super().__init__(base.in_features, (hi - lo) * head_dim, bias=base.bias is not None, device="meta")
        self._join(group)
        self.rows = lo * head_dim, hi * head_dim

    def shard_weight(self, local: str, sl) -> torch.Tensor:
        return sl[self.rows[0]:self.rows[1]]  # weight rows or bias entries alike


class RowParallelLinear(_Sharded, nn.Linear):
    """Input features split; partial outputs are summed across ranks, then the (replicated) bias added."""
    split = {"weight": 1}

    def __init__(self, base: nn.Linear, group):
        world = dist.get_world_size(group)
        super().__init__(base.in_features // world, base.out_features, bias=base.bias is not None, device="meta")
        self._join(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class PartialRowLinear(_Sharded, nn.Linear):
    """Input features split, its partial output left unsummed: an expert's down projection, whose rank-partial
    outputs the MoE block weights, adds up and all-reduces once for all its experts (model/moe.py). A bias
    (gpt-oss's experts') is replicated and added by rank 0 alone, so the sum holds it once."""
    split = {"weight": 1}

    def __init__(self, base: nn.Linear, group):
        world = dist.get_world_size(group)
        super().__init__(base.in_features // world, base.out_features, bias=base.bias is not None, device="meta")
        self._join(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.rank == 0 else None)


def _split_sinks(attn, group) -> None:
    """gpt-oss's attention sinks, one per query head: each rank keeps its heads' (q_proj's column split)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = _span(attn.sinks.shape[0], rank, world)
    attn.sinks = nn.Parameter(torch.empty(hi - lo, device="meta"), requires_grad=False)
    attn.shard_weight = lambda local, sl: sl[lo:hi]  # the loader reads a module's own tensors through it


def projection_norm(norm, h: torch.Tensor, sum_sq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`norm`'s ops on its rank's slice h (fp32) of a norm.full-wide projection, given the whole projection's
    sum of squares: only that sum's order of additions differs from one rank's."""
    normed = h * sum_sq.div_(norm.full).add_(norm.eps).rsqrt_()
    if isinstance(norm, WeightFirstRMSNorm):  # OLMo 2's: the weight in fp32, then the cast
        return (norm.weight * normed).to(dtype)
    return norm.weight * normed.to(dtype)  # Llama's order (OLMoE's): the cast, then the weight


def _sharded_norm_qk(attn, group, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Whole-projection q / k norms over a rank's heads: the ranks' sums of squares of q and of k, summed in one
    all-reduce, give the whole projections' mean squares."""
    hq, hk = q.float(), k.float()
    sums = torch.cat([(hq * hq).sum(-1, keepdim=True), (hk * hk).sum(-1, keepdim=True)], dim=-1)
    dist.all_reduce(sums, group=group)
    sq, sk = sums.split(1, dim=-1)
    return torch.cat([projection_norm(attn.q_norm, hq, sq, q.dtype), projection_norm(attn.k_norm, hk, sk, k.dtype)],
                     dim=-1)


def _split_projection_norms(attn, group, num_kv_heads: int) -> None:
    """OLMo 2's (and OLMoE's) q / k norms span every head: each rank keeps its heads' slice of each norm's weight
    (as q_proj's and k_proj's splits) and computes it with the other ranks' sums (_sharded_norm_qk). A KV head
    replicated on r ranks enters the summed squares r times: k_norm then counts its width r times too."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    replicas = max(1, world // num_kv_heads)
    for norm in (attn.q_norm, attn.k_norm):
        if type(norm) not in (RMSNorm, WeightFirstRMSNorm):
            raise ValueError(f"tensor parallel cannot split a whole-projection {type(norm).__name__}")
        width = norm.weight.shape[0]
        if norm is attn.q_norm:
            norm.full, (lo, hi) = width, _span(width, rank, world)
        else:
            head_dim = width // num_kv_heads
            norm.full, (lo, hi) = width * replicas, [h * head_dim for h in kv_head_span(num_kv_heads, rank, world)]
        norm.weight = nn.Parameter(torch.empty(hi - lo, device="meta"), requires_grad=False)
        norm.shard_weight = lambda local, sl, lo=lo, hi=hi: sl[lo:hi]  # the loader reads the slice through it
    attn.norm_qk = lambda q, k: _sharded_norm_qk(attn, group, q, k)


class VocabParallelEmbedding(_Sharded, nn.Embedding):
    split = {"weight": 0}

    def __init__(self, base: nn.Embedding, group):
        rows = -(-base.num_embeddings // dist.get_world_size(group))
        # _weight: no random init (see layers.Decoder)
        super().__init__(rows, base.embedding_dim, _weight=torch.empty(rows, base.embedding_dim, device="meta"))
        self._join(group)
        self.lo = self.rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelLMHead(_Sharded, nn.Linear):
    split = {"weight": 0}

    def __init__(self, base: nn.Linear, group):
        super().__init__(base.in_features, -(-base.out_features // dist.get_world_size(group)), bias=False, device="meta")
        self._join(group)
        self.vocab_size = base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def _split_sizes(attn, mlp) -> dict:
    """What tensor parallel divides among the ranks: heads, and the (each expert's) MLP width."""
    sizes = {"num_attention_heads": attn.num_heads, "num_key_value_heads": attn.num_kv_heads}
    if isinstance(mlp, SparseMoeBlock):
        shared = getattr(mlp, "shared_expert", None)  # Qwen2-MoE's, split by width as an expert
        return {**sizes, "moe_intermediate_size": mlp.experts[0].gate_proj.out_features,
                **({"shared_expert_intermediate_size": shared.gate_proj.out_features} if shared else {})}
    return {**sizes, "intermediate_size": mlp.gate_proj.out_features}


def _split_mlp(mlp, group) -> None:
    """Each (expert's) MLP width split: gate / up column-parallel, down row-parallel. A sparse block's
    router stays replicated (every rank routes alike) and its experts' partial outputs are all-reduced once;
    Qwen2-MoE's shared expert is split as an expert, its gate replicated."""
    if not isinstance(mlp, SparseMoeBlock):
        mlp.gate_proj, mlp.up_proj = ColumnParallelLinear(mlp.gate_proj, group), ColumnParallelLinear(mlp.up_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
        return
    for expert in [*mlp.experts, *([mlp.shared_expert] if hasattr(mlp, "shared_expert") else [])]:
        expert.gate_proj, expert.up_proj = (ColumnParallelLinear(expert.gate_proj, group),
                                            ColumnParallelLinear(expert.up_proj, group))
        expert.down_proj = PartialRowLinear(expert.down_proj, group)
    mlp.tp_group = group


KV_REPLICAS_NOTE = (" (or, with fewer KV heads than ranks, be a multiple of num_key_value_heads: each KV head is "
                    "then replicated)")


def unsplittable(sizes: dict[str, int], world: int) -> list[str]:
    """The sizes (config.json's names) that tensor parallel over `world` ranks cannot split: each must be a
    multiple of world, but num_key_value_heads below world, which must divide it (each KV head replicated)."""
    def fits(name: str, size: int) -> bool:
        return world % size == 0 if name == "num_key_value_heads" and size < world else size % world == 0
    return [f"{name}={size}" for name, size in sizes.items() if not fits(name, size)]


def split_sizes(cfg) -> dict[str, int]:
    """What tensor parallel divides among the ranks, from a ModelConfig (before any weight loads): the heads,
    and the MLP widths its layers use (the dense one, each expert's, Qwen2-MoE's shared expert's)."""
    sizes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    sparse = [cfg.is_sparse(i) for i in range(cfg.num_layers)]
    if not all(sparse):
        sizes["intermediate_size"] = cfg.intermediate_size
    if any(sparse):
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return sizes


def apply_tensor_parallel(model: nn.Module, group):
    """Swap the built model's layers for their parallel versions and shrink per-rank head counts."""
    world = dist.get_world_size(group)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        bad = unsplittable(_split_sizes(attn, mlp), world)
        if bad:
            note = KV_REPLICAS_NOTE if any(b.startswith("num_key_value_heads") for b in bad) else ""
            raise ValueError(f"tensor parallel size {world} must divide {', '.join(bad)}{note}")
        kv_heads = attn.num_kv_heads
        attn.num_heads, attn.num_kv_heads = attn.num_heads // world, max(1, kv_heads // world)
        attn.q_proj = ColumnParallelLinear(attn.q_proj, group)
        attn.k_proj, attn.v_proj = (KVParallelLinear(attn.k_proj, group, kv_heads),
                                    KVParallelLinear(attn.v_proj, group, kv_heads))
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        if getattr(attn, "sinks", None) is not None:
            _split_sinks(attn, group)
        if isinstance(attn, ProjectionNormAttention):
            _split_projection_norms(attn, group, kv_heads)
        _split_mlp(mlp, group)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, group)
    model.lm_head = VocabParallelLMHead(model.lm_head, group)
