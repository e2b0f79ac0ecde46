"""The forward's fewer-op spellings compute exactly, bit for bit, what the spelled-out forms compute."""
from __future__ import annotations

import pytest
import torch

from saguaro_dist.model import ModelRunner
from saguaro_dist.model.attention import fold_heads
from saguaro_dist.model.layers import RMSNorm
from saguaro_dist.model.rope import apply_rope, rope_tables

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_signed_sin_is_rotate_half_bit_for_bit(dtype):
    head_dim, rope = 48, {"rope_theta": 10000.0, "rope_type": "default"}
    cos, signed_sin = rope_tables(head_dim, rope, 64, "cpu", dtype)
    sin = torch.cat([-signed_sin[:, :head_dim // 2], signed_sin[:, head_dim // 2:]], dim=-1)
    x = torch.randn(2, 5, 3, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    pos = torch.arange(10, 20).view(2, 5)
    c, s, ss = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2), signed_sin[pos].unsqueeze(2)
    assert torch.equal(apply_rope(x, c, ss), x * c + rotate_half(x) * s)


@pytest.mark.parametrize("hidden", [96, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_transformers_formula_bit_for_bit(dtype, hidden):
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    for scale in (0.01, 1.0, 30.0):
        x = (torch.randn(3, 7, hidden, generator=torch.Generator().manual_seed(2)) * scale).to(dtype)
        h = x.float()
        expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        with torch.no_grad():
            assert torch.equal(norm(x), expected)


def test_fold_heads_without_grouping_is_a_transposed_view():
    q = torch.randn(2, 5, 4, 8)
    folded = fold_heads(q, kv_heads=4)
    assert folded.shape == (2, 4, 5, 8) and folded.data_ptr() == q.data_ptr()
    assert torch.equal(folded, q.permute(0, 2, 1, 3))


def test_branch_decode_on_scattered_rows_equals_contiguous_rows(tiny_checkpoint):
    """Scattered pool rows gather every layer's prefix once per step; consecutive rows take views."""
    torch.set_num_threads(1)
    path = tiny_checkpoint("llama")
    prompts = {"a": list(range(3, 20)), "b": list(range(7, 15))}

    def run(scatter: bool):
        runner = ModelRunner(path)
        for sid in ["a", "gap", "b"] if scatter else ["a", "b"]:
            runner.add(sid)
        if scatter:
            runner.free("gap")
        for sid, toks in prompts.items():
            runner.extend([sid], [toks], [1])
        state, first = runner.branch_start(["a", "b", "a", "b"], [17, 8, 10, 5], [1, 2, 3, 4])
        return [first] + [runner.branch_step(state, torch.tensor([5, 6, 7, 8]) + d) for d in range(3)]

    scattered, contiguous = run(scatter=True), run(scatter=False)  # rows 0, 2 (a gather) vs 0, 1 (a view)
    for got, want in zip(scattered, contiguous):
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_causal_kernel_equals_the_masked_attention_for_prompts_from_position_0(heads, kv_heads):
    """ExtendBatch runs whole prompts (every row from position 0) through SDPA's causal kernel: the same
    output as the masked dense attention over the folded heads, for every real query of a padded row."""
    from saguaro_dist.model.attention import causal_attention, causal_mask, dense_attention, fold_heads, unfold_heads
    gen = torch.Generator().manual_seed(0)
    b, t, d = 2, 9, 16
    q = torch.randn(b, t, heads, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, t, d, generator=gen) for _ in range(2))
    pos = torch.arange(t).expand(b, t)
    masked = unfold_heads(dense_attention(fold_heads(q, kv_heads), k, v, causal_mask(pos, t, heads // kv_heads, q.dtype)), t)
    torch.testing.assert_close(causal_attention(q, k, v), masked, atol=1e-6, rtol=0)
