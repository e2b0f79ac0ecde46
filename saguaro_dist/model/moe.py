"""Sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, gpt-oss) as transformers 5.25 computes
them: a router linear, softmax over the experts in fp32, the top-k, renormalised (Mixtral always, the others per
norm_topk_prob), each chosen expert's SwiGLU times its weight, summed over the k in the order the router ranked
them (transformers' default grouped_mm experts: products [N, k, H], then a sum over k); Qwen2-MoE then adds its
shared expert, gated by sigmoid(shared_expert_gate(x)). gpt-oss's router has a bias and takes the top-k logits
first, then a softmax over those k; its experts have biases and a clamped SwiGLU."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from saguaro_dist.model.hf_config import ModelConfig
from saguaro_dist.model.layers import MLP, PlainModule


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool,
          weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k] in weights_dtype, experts [N, k] int64), best first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), experts


def route_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's (GptOssTopKRouter): the top-k logits, then a softmax over them in their dtype; best first."""
    top, experts = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), experts


def mix_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, modules) -> torch.Tensor:
    """x [N, H], weights / experts [N, k] -> sum_k weights[:, k] * modules[experts[:, k]](x), [N, H] in the
    promoted dtype of x and the weights (cast by the caller). Each expert runs once, on the tokens routed
    to it: the loop is data-dependent (a host sync), which is why MoE models run without CUDA graphs."""
    out = x.new_zeros((*experts.shape, x.shape[-1]), dtype=torch.promote_types(x.dtype, weights.dtype))
    for e in experts.unique().tolist():
        token, slot = (experts == e).nonzero(as_tuple=True)
        out[token, slot] = modules[e](x[token]) * weights[token, slot, None]
    return out.sum(dim=1)


class SparseMoeBlock(PlainModule):
    """Parameter names as transformers' Qwen3-MoE Hub files (mlp.gate, mlp.experts.E.gate_proj / up_proj /
    down_proj); the loader maps Mixtral's and transformers' fused layouts onto them (model/loader.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size, bias=False) for _ in range(cfg.num_experts))
        self.top_k, self.renormalise = cfg.experts_per_token, cfg.renormalise_topk
        self.weights_fp32 = cfg.routing_weights_fp32
        self.tp_group = None  # tensor parallel (model/tp.py): each rank's partial sums all-reduced once, here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        out = mix_experts(flat, weights, experts, self.experts)
        if self.tp_group is not None:
            dist.all_reduce(out, group=self.tp_group)
        return out.to(x.dtype).view_as(x)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.gate(flat), self.top_k, self.renormalise,
                     torch.float32 if self.weights_fp32 else flat.dtype)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's (Qwen2MoeSparseMoeBlock): the routed experts' sum plus sigmoid(shared_expert_gate(x)) times
    a dense SwiGLU of shared_expert_intermediate_size (mlp.shared_expert, mlp.shared_expert_gate: the Hub's
    names). Tensor parallel splits the shared expert's width as an expert's; its partial output joins the
    routed ones' before the block's one all-reduce (the gate scales each rank's part alike: it is replicated)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size, bias=False)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        out = mix_experts(flat, weights, experts, self.experts)
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        if self.tp_group is not None:
            dist.all_reduce(out, group=self.tp_group)
        return out.to(x.dtype).view_as(x)


class ClampedSwiGLUExpert(MLP):
    """gpt-oss's expert (GptOssExperts._apply_gate): the gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate); every projection with a bias. Our gate / up are the checkpoint's
    interleaved gate_up_proj columns, de-interleaved on load (model/loader.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.moe_intermediate_size, bias=True)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoeBlock(SparseMoeBlock):
    """gpt-oss's (GptOssMLP): mlp.router (a linear with bias) and mlp.experts.E.gate_proj / up_proj / down_proj,
    our names for its stacked (or MXFP4) experts' slices (model/loader.py)."""

    def __init__(self, cfg: ModelConfig):
        PlainModule.__init__(self)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = nn.ModuleList(ClampedSwiGLUExpert(cfg) for _ in range(cfg.num_experts))
        self.top_k = cfg.experts_per_token
        self.tp_group = None  # tensor parallel: as SparseMoeBlock's (rank 0 alone adds the down projections' biases)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_top_logits(self.router(flat), self.top_k)


def has_experts(model: nn.Module) -> bool:
    return any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)

