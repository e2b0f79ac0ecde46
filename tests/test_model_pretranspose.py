"""CPU linears stored [in, out] compute what nn.Linear did (the parity tests cover whole models)."""
import pytest
import torch
from torch import nn

from saguaro_dist.demo import demo_pair
from saguaro_dist.model import pretranspose
from saguaro_dist.model.layers import PlainModule
from saguaro_dist.model.pretranspose import PretransposedLinear, pretranspose_linears
from saguaro_dist.model.runner import ModelRunner


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 16)])
def test_pretransposed_linear_equals_the_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(16, 24, bias=bias)
    x = torch.randn(*shape)
    torch.testing.assert_close(PretransposedLinear(linear)(x), linear(x), rtol=0, atol=1e-6)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_head_is_copied_only_while_small(monkeypatch):
    small = Tied()
    pretranspose_linears(small)
    assert isinstance(small.proj, PretransposedLinear) and isinstance(small.head, PretransposedLinear)
    assert small.embed.weight.shape == (32, 8)  # the embedding keeps its rows
    monkeypatch.setattr(pretranspose, "TIED_TABLE_LIMIT", 32 * 8 * 4 - 1)
    big = Tied()
    pretranspose_linears(big)
    assert isinstance(big.proj, PretransposedLinear) and type(big.head) is nn.Linear


def test_a_cpu_runner_has_no_plain_linear_left():
    _, draft = demo_pair()
    runner = ModelRunner(draft, device="cpu")
    assert not [n for n, m in runner.model.named_modules() if type(m) is nn.Linear]


def test_a_cpu_runner_calls_its_modules_past_the_hook_machinery():
    """Every module a CPU forward calls per layer is a PlainModule (its call goes straight to forward),
    and such a call returns what forward does."""
    _, draft = demo_pair()
    runner = ModelRunner(draft, device="cpu")
    hooked = [n for n, m in runner.model.named_modules()
              if not isinstance(m, PlainModule) and n not in ("model", "model.layers", "model.embed_tokens")]
    assert hooked == []
    norm = runner.model.model.norm
    x = torch.randn(2, 3, norm.weight.shape[0])
    assert torch.equal(norm(x), norm.forward(x))
