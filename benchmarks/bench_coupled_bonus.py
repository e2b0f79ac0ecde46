"""How often a tree's bonus candidates hold the real bonus: the draft's top-F against coupled draws.

    python benchmarks/bench_coupled_bonus.py [--rounds 128] [--temperature 0.7] [--budgets 5,8,12] [--target T --draft D]

Offline, no engine, no timing: for held-out demo snippets cut after their first 96 tokens, the draft
samples K tokens, the target scores them, and rejection sampling picks the outcome k* and the bonus's
distribution r (spec/verify.py), as a verify would. For each budget, the same F_k per outcome position
(Theorem 12's allocation for the P(k*) measured here) is then filled two ways:
  top-F:   the draft's F_k likeliest tokens (spec/branches.py); hit probability r(S), exact;
  coupled: F_k candidates drawn from the draft's guess, the bonus drawn against them (spec/coupled.py),
           with the guess cut to GUESS_TOP tokens as the engine sends it, and whole; Monte Carlo.
What it shows is what a tree can hit at all, before any cost: where coupled draws beat top-F, the same
budget hits more (or a smaller one as often).
"""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saguaro_dist.demo import demo_pair, demo_prompts
from saguaro_dist.spec.coupled import GUESS_TOP, bonus_guess, coupled_bonus, dense_guess, draw_candidates, sparse_guess
from saguaro_dist.spec.fanout import outcome_fanout
from saguaro_dist.spec.verify import bonus_probs, verify

R_DEFAULT = 0.5  # the miss-rate power law's exponent before any is fitted (spec/stats.py starts there too)


def next_probs(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(ids[None]).logits[0].float() / temperature, dim=-1)


def one_round(target, draft, ids: torch.Tensor, k: int, temperature: float, gen: torch.Generator):
    """(k*, r [V], the draft's guesses [K+1, V]) of one sampled round after the prefix `ids`."""
    seq, qs, xs = ids, [], []
    for i in range(k + 1):
        q = next_probs(draft, seq, temperature)[-1]
        qs.append(q)
        if i < k:
            xs.append(int(torch.multinomial(q, 1, generator=gen)))
            seq = torch.cat([seq, torch.tensor(xs[-1:])])
    p = next_probs(target, seq, temperature)[-(k + 1):][None]
    tokens, q = torch.tensor([xs]), torch.stack(qs[:k])[None]
    accepted = verify(p, tokens, q, [gen]).accepted
    residual = bonus_probs(p, tokens, q, accepted)[0]
    return int(accepted), residual, bonus_guess(torch.stack(qs)[None], tokens)[0]


def top_f_hit(residual: torch.Tensor, guess: torch.Tensor, f: int) -> float:
    return float(residual[guess.topk(f).indices].sum())


def coupled_hit(residual: torch.Tensor, guess: torch.Tensor, f: int, draws: int, gen: torch.Generator) -> float:
    v = guess.shape[0]
    cands = draw_candidates(guess.expand(draws, v), f, torch.rand(draws, v, generator=gen, dtype=torch.float64))
    bonus = coupled_bonus(residual.expand(draws, v), guess.expand(draws, v), cands,
                          torch.rand(draws, f + 1, generator=gen, dtype=torch.float64))
    return float((bonus[:, None] == cands).any(1).double().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=128, help="sampled rounds (4 cuts of each snippet)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--budgets", default="5,8,12")
    p.add_argument("--draws", type=int, default=256, help="Monte Carlo draws per round for the coupled rates")
    p.add_argument("--target"), p.add_argument("--draft")
    args = p.parse_args()
    if args.temperature <= 0:
        p.error("--temperature must be > 0: greedy rows keep top-F (their bonus is the target's argmax)")
    torch.set_num_threads(1)
    target_dir, draft_dir = (args.target, args.draft) if args.target else demo_pair()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target, draft = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (target_dir, draft_dir))
    gen = torch.Generator().manual_seed(0)
    snippets = demo_prompts(max(1, (args.rounds + 3) // 4))
    rounds = [one_round(target, draft, tok(text, return_tensors="pt").input_ids[0][:96], args.k, args.temperature, gen)
              for text in snippets for _ in range(4)][:args.rounds]
    outcome_probs = [sum(1 for r in rounds if r[0] == j) / len(rounds) for j in range(args.k + 1)]
    print(f"{len(rounds)} rounds, T = {args.temperature}, K = {args.k}; P(k*) = {[round(x, 3) for x in outcome_probs]}")
    for budget in (int(b) for b in args.budgets.split(",")):
        fanout = outcome_fanout(budget, outcome_probs, R_DEFAULT)
        rates = {"top-F": 0.0, f"coupled (guess top {GUESS_TOP})": 0.0, "coupled (whole guess)": 0.0}
        for k, residual, guesses in rounds:
            guess, f = guesses[k], fanout[k]
            cut = dense_guess(*sparse_guess(guess[None]), guess.shape[0])[0]
            rates["top-F"] += top_f_hit(residual, guess, f)
            rates[f"coupled (guess top {GUESS_TOP})"] += coupled_hit(residual, cut, f, args.draws, gen)
            rates["coupled (whole guess)"] += coupled_hit(residual, guess, f, args.draws, gen)
        shown = ", ".join(f"{name} {total / len(rounds):.3f}" for name, total in rates.items())
        print(f"budget {budget:3d}, F_k {fanout}: expected hit rate {shown}")


if __name__ == "__main__":
    main()
