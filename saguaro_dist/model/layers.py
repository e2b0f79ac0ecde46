"""The decoder (Llama / Mistral / Qwen2 / Qwen3 / Granite / OLMo 2 / Gemma 2 / Gemma 3 / Mixtral / Qwen3-MoE /
Phi-3 / gpt-oss / SmolLM3 / Qwen2-MoE / OLMoE) as plain modules; attention over stored KV is left to a batch context (`ctx.attend`),
so the same layers serve batched extend and branch decode."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from saguaro_dist.model.attention import attention_kernel
from saguaro_dist.model.hf_config import ModelConfig
from saguaro_dist.model.rope import apply_partial_rope, apply_rope, no_rope


class PlainModule(nn.Module):
    """Called straight into its forward, past nn.Module's hook machinery (~2.5 us a call, and a 2-layer
    draft forward makes 20 such calls: a CPU forward is bound by per-call overhead, not FLOPs). The
    engine's modules are never hooked; hooks registered on one are not run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RMSNorm(PlainModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers computes it: normalised in fp32, cast back, then the weight in the input dtype.
        # mean is sum then div_ in ATen, and pow(2) is x * x: bitwise the same (tests/test_model_ops.py),
        # in fewer ops than F.rms_norm, whose CPU kernel is the spelled-out form plus two dtype copies
        # (a demo-draft tree 3.6% faster, session 36). No weight inside: that would change the rounding.
        h = x.float()
        return self.weight * (h * (h * h).sum(-1, keepdim=True).div_(h.shape[-1]).add_(self.eps).rsqrt_()).to(x.dtype)


class WeightFirstRMSNorm(RMSNorm):
    """OLMo 2's (Olmo2RMSNorm): the weight multiplies the fp32 normalised input, then the cast (Llama's
    casts first); the same values in fp32, not in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * (h * h).sum(-1, keepdim=True).div_(h.shape[-1]).add_(self.eps).rsqrt_())).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's (Gemma3RMSNorm): the weight stored as an offset from 1, x * (1 + weight) all in fp32, then
    the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        normed = h * (h * h).sum(-1, keepdim=True).div_(h.shape[-1]).add_(self.eps).rsqrt_()
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Attention(PlainModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.attention_scale  # Granite's attention_multiplier; None (SDPA's 1/sqrt(head_dim)) passes none
        self.window = cfg.window_of(layer_idx)  # this layer's sliding window; None (full attention) passes none
        # chosen once per layer: Phi-3's partial rotary factor, SmolLM3's NoPE layers (no rope op at all)
        self.rotate = (apply_partial_rope if cfg.rotary_dim else apply_rope) if cfg.rotates(layer_idx) else no_rope

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """Runs on the fused `qkv_proj` that build_model makes from q/k/v_proj once the weights load."""
        b, t, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).split([self.qkv_sizes[0] + self.qkv_sizes[1], self.qkv_sizes[2]], dim=-1)
        qk = qk.view(b, t, heads + kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])], dim=2)
        # q's and k's heads rotate by the same position: one RoPE pass over both (half the small ops).
        qk = self.rotate(qk, ctx.cos, ctx.signed_sin)
        v = v.view(b, t, kv_heads, self.head_dim)
        return self.o_proj(self._attend(ctx, qk[:, :, :heads], qk[:, :, heads:], v))

    def _attend(self, ctx, q, k, v) -> torch.Tensor:
        """ctx.attend, passed only the options this layer has (Llama's path passes none)."""
        if self.scale is None and self.window is None:
            return ctx.attend(self.layer_idx, q, k, v)
        return ctx.attend(self.layer_idx, q, k, v, scale=self.scale, window=self.window)


class SinkAttention(Attention):
    """gpt-oss's: a learned logit per head (`sinks`, [num_heads]) joins every softmax (attention.sink_attention,
    the model's kernel); tensor parallel keeps each rank's heads' (model/tp.py)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def _attend(self, ctx, q, k, v) -> torch.Tensor:
        return ctx.attend(self.layer_idx, q, k, v, scale=self.scale, window=self.window, sinks=self.sinks)


class ProjectionNormAttention(Attention):
    """OLMo 2's: q and k each RMS-normalised over the whole projection (all heads at once), before RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = WeightFirstRMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = WeightFirstRMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        qk = self.norm_qk(q, k).view(b, t, heads + kv_heads, self.head_dim)
        # fp32 tables (cfg.rope_fp32) rotate a bf16 q / k in fp32, as Olmo2's apply_rotary_pos_emb; cast back
        qk = apply_rope(qk, ctx.cos, ctx.signed_sin).to(v.dtype)
        v = v.view(b, t, kv_heads, self.head_dim)
        return self.o_proj(self._attend(ctx, qk[:, :, :heads], qk[:, :, heads:], v))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q and k normalised, side by side. Tensor parallel replaces it (model/tp.py: a rank's slices, the
        mean squares over every rank's heads)."""
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)


class ClippedProjectionNormAttention(ProjectionNormAttention):
    """OLMoE's (OlmoeAttention): OLMo 2's q / k norms over whole projections, but Llama's norm order (cast, then
    the weight); with clip_qkv, q and k (after their norms) and v clamped to [-clip, clip] before RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.clip = cfg.qkv_clip

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        qk = self.norm_qk(q, k)  # tensor parallel's own, when split (model/tp.py)
        if self.clip is not None:
            qk, v = qk.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        qk = apply_rope(qk.view(b, t, heads + kv_heads, self.head_dim), ctx.cos, ctx.signed_sin)
        v = v.view(b, t, kv_heads, self.head_dim)
        return self.o_proj(self._attend(ctx, qk[:, :, :heads], qk[:, :, heads:], v))


class TwoRopeAttention(Attention):
    """Gemma 3's: per-head q / k norms (OffsetRMSNorm), and sliding layers rotate by their own rope. The
    runner's tables then hold both ropes side by side ([global | local] on the last axis, rope.py); each
    layer reads its half."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        local = self.window is not None  # a sliding layer (gemma3_config.gemma3_windows)
        self.rope_half = slice(cfg.head_dim, None) if local else slice(0, cfg.head_dim)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).split([self.qkv_sizes[0] + self.qkv_sizes[1], self.qkv_sizes[2]], dim=-1)
        qk = qk.view(b, t, heads + kv_heads, self.head_dim)
        qk = torch.cat([self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])], dim=2)
        qk = apply_rope(qk, ctx.cos[..., self.rope_half], ctx.signed_sin[..., self.rope_half])
        v = v.view(b, t, kv_heads, self.head_dim)
        return self.o_proj(self._attend(ctx, qk[:, :, :heads], qk[:, :, heads:], v))


class MLP(PlainModule):
    def __init__(self, cfg: ModelConfig, width: int | None = None, bias: bool | None = None):
        """width, bias: an expert's (model/moe.py); None: the dense MLP's intermediate_size and mlp_bias."""
        super().__init__()
        width = cfg.intermediate_size if width is None else width
        bias = cfg.mlp_bias if bias is None else bias
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs on the fused `gate_up_proj` that build_model makes from gate/up_proj."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GeluTanhMLP(MLP):
    """Gemma's: gelu_pytorch_tanh (transformers' GELUTanh: F.gelu, approximate "tanh") gates it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def _feed_forward(cfg: ModelConfig, layer_idx: int) -> PlainModule:
    """The layer's MLP: dense, or (Mixtral, OLMoE, Qwen3-MoE's and Qwen2-MoE's sparse layers, gpt-oss's) a mixture
    of experts (Qwen2-MoE's with its shared expert)."""
    if not cfg.is_sparse(layer_idx):
        return MLP(cfg)
    from saguaro_dist.model.moe import GptOssMoeBlock, SharedExpertMoeBlock, SparseMoeBlock  # moe.py builds on MLP
    if cfg.swiglu_limit is not None:
        return GptOssMoeBlock(cfg)
    return (SharedExpertMoeBlock if cfg.shared_expert_intermediate_size else SparseMoeBlock)(cfg)


class DecoderLayer(PlainModule):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = _feed_forward(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class SinkLayer(DecoderLayer):
    """gpt-oss's: Llama's layout, its attention with sinks, its norms weight-first (GptOssRMSNorm's order)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.self_attn = SinkAttention(cfg, layer_idx)
        self.input_layernorm = WeightFirstRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = WeightFirstRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ProjectionNormLayer(DecoderLayer):
    """OLMoE's: Llama's layout (norms before each sublayer), its attention ClippedProjectionNormAttention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.self_attn = ClippedProjectionNormAttention(cfg, layer_idx)


class ScaledResidualLayer(DecoderLayer):
    """Granite's: each sublayer's output times residual_multiplier before the residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class PostNormLayer(PlainModule):
    """OLMo 2's: no norm before a sublayer; its output is normalised, then added to the residual."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ProjectionNormAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = WeightFirstRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = WeightFirstRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class SandwichNormLayer(PlainModule):
    """Gemma 2's and 3's: a norm before each sublayer and one on its output, before the residual add. Gemma 3's
    attention has per-head q / k norms and a rope of its own on sliding layers; Gemma 2's neither (one rope)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = (TwoRopeAttention if cfg.local_rope is not None else Attention)(cfg, layer_idx)
        self.mlp = GeluTanhMLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _layer_class(cfg: ModelConfig) -> type:
    """A family's layer; Llama's unless it adds ops (a Granite residual_multiplier of 1 adds none)."""
    if cfg.sandwich_norms:
        return SandwichNormLayer
    if cfg.post_norms:
        return PostNormLayer
    if cfg.attention_sinks:
        return SinkLayer
    if cfg.projection_qk_norms:
        return ProjectionNormLayer
    return DecoderLayer if cfg.residual_multiplier == 1.0 else ScaledResidualLayer


class Decoder(nn.Module):
    """Parameter names mirror transformers' `model.*` so checkpoints load by name."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # _weight skips the random init: on meta its normal_ imports torch._dynamo (~1 s per process).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer = _layer_class(cfg)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        weight_first = cfg.post_norms or cfg.weight_first_norms
        norm = OffsetRMSNorm if cfg.sandwich_norms else WeightFirstRMSNorm if weight_first else RMSNorm
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(PlainModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Granite's; at 1 (every other family) no multiply or divide runs
        self.embedding_multiplier, self.logits_scaling = cfg.embedding_multiplier, cfg.logits_scaling
        self.embed_scale = None  # Gemma's: a tensor in the model's dtype, set by set_embed_scale once built
        # every step context attends with it: SDPA's but for Gemma 2's softcap and gpt-oss's sinks
        self.attention = attention_kernel(cfg.attn_softcap, cfg.attention_sinks)
        self.final_softcap = cfg.final_softcap  # Gemma 2's; None: no op

    def set_embed_scale(self, scale: float | None, dtype: torch.dtype, device) -> None:
        """Gemma's sqrt(hidden_size) as transformers' Gemma3TextScaledWordEmbedding multiplies it: an fp32
        tensor cast to the weights' dtype (sqrt(1152) = 33.94 is 34.0 in bf16), then a tensor multiply."""
        self.embed_scale = None if scale is None else torch.tensor(scale).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids: [B, T] -> final hidden states [B, T, hidden] (the LM head runs on the rows asked for)."""
        x = self.model.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits if self.final_softcap is None else softcap(logits, self.final_softcap)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, as transformers' Gemma2ForCausalLM softcaps its logits."""
    return torch.tanh(x / cap) * cap
