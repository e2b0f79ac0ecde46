"""Measurements of a built pair: held-out loss and greedy speculative acceptance."""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq_len: int, windows: int) -> float:
    """Mean next-token CE (nats) over evenly spaced, fixed held-out windows."""
    span = len(tokens) - seq_len - 1
    if span <= 0:
        raise ValueError(f"held-out split has {len(tokens)} tokens; need more than {seq_len + 1}")
    starts = torch.linspace(0, span, windows).long().unique().tolist()
    losses = []
    for s in starts:
        window = tokens[s:s + seq_len + 1].long().unsqueeze(0)
        logits = model(input_ids=window[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits[0], window[0, 1:]).item())
    return sum(losses) / len(losses)


def cache_arg(model) -> str:
    """The forward's KV-cache argument: transformers 5.x calls it `cache` (`past_key_values`, deprecated
    there, goes in 5.40); 4.x only knows `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos_id: int) -> list[int]:
    """Greedy continuation of ids (up to n tokens, stops after EOS), with a KV cache."""
    name, new = cache_arg(model), []
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        new.append(token)
        if token == eos_id:
            break
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{name: getattr(out, name)})
    return new


def matched(proposal: list[int], reference: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, reference):
        if a != b:
            break
        n += 1
    return n


def simulate_prompt(target, draft, ids: list[int], k: int, new_tokens: int, eos_id: int) -> tuple[int, int, int, int]:
    """Greedy SD on one prompt: (accepted, drafted, rounds, rejections). Under greedy the output is
    the target's own greedy continuation, so each round accepts the draft's longest matching prefix."""
    reference = greedy(target, ids, new_tokens, eos_id)
    accepted = drafted = rounds = rejections = pos = 0
    while pos < len(reference):
        want = min(k, len(reference) - pos)
        proposal = greedy(draft, ids + reference[:pos], want, eos_id)
        a = matched(proposal, reference[pos:pos + want])
        accepted, drafted, rounds = accepted + a, drafted + want, rounds + 1
        rejections += a < want
        pos += a + 1  # the accepted tokens plus the target's bonus token
    return accepted, drafted, rounds, rejections


def greedy_acceptance(target, draft, prompts: list[list[int]], k: int, new_tokens: int, eos_id: int) -> dict:
    from tqdm.auto import tqdm

    totals = [0, 0, 0, 0]  # accepted, drafted, rounds, rejections
    for ids in tqdm(prompts, desc=f"acceptance K={k}", unit="prompt"):
        totals = [t + x for t, x in zip(totals, simulate_prompt(target, draft, ids, k, new_tokens, eos_id))]
    accepted, drafted, rounds, rejections = totals
    # acceptance: accepted / drafted tokens. per_token_acceptance: P(a compared draft token matches).
    return {"k": k, "prompts": len(prompts), "new_tokens": new_tokens,
            "acceptance": accepted / max(1, drafted),
            "per_token_acceptance": accepted / max(1, accepted + rejections),
            "mean_accepted_per_round": accepted / max(1, rounds)}
