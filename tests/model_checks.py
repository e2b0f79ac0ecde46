"""What the model-runtime tests share: tiny checkpoints made to expose attention bugs, token streams, and
logits read from transformers and from our runner along the decode path."""
from __future__ import annotations

import torch

QK_GAIN = 8.0  # HF's init leaves attention near uniform, whatever its scale or mask: a bug there would hide


def randomise(model, sharpen: float = 1.0, qk_gain: float = QK_GAIN) -> None:
    """In place: norms off their init, q and k scaled up (a key wrongly seen or hidden, or a wrong scale, then
    moves the logits), the output head by `sharpen` (peaked distributions, as a real LM's, for greedy runs)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
        model.get_output_embeddings().weight.mul_(sharpen)


def save_seeded(path, model_cls, make_config, seed: int = 0, sharpen: float = 1.0):
    """A seeded tiny checkpoint written by transformers, randomised as above; the model, for reference logits."""
    torch.manual_seed(seed)
    model = model_cls(make_config()).eval()
    randomise(model, sharpen)
    model.save_pretrained(path)
    return model


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0].float()


def runner_logits(runner, seq: list[int]) -> torch.Tensor:
    """Logits of seq: its first half prefilled, then one token a step (the decode path's positions)."""
    runner.add("s")
    half = len(seq) // 2
    got = [runner.extend(["s"], [seq[:half]], [half])[0]]
    got += [runner.extend(["s"], [[t]], [1])[0] for t in seq[half:]]
    runner.free("s")
    return torch.cat(got)
