"""Greedy departures from our ar, judged. A speculative system scores K + 1 positions in one forward, which
rounds differently from one at a time; it may depart from autoregressive decoding only where the target's
top two logits nearly tie. A departure where the target is sure is a broken verifier, and the bench says so.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)

NEAR_TIE = 1e-4  # absolute top-2 logit gap under which fp32 reordering may flip a greedy choice
# Relative to |top logit|, the rounding of the run's dtype: 4 units in its last place (bf16 keeps 8 bits, fp16 11).
RELATIVE_NEAR_TIE = {"float32": 0.0, "bfloat16": 4 * 2.0 ** -8, "float16": 4 * 2.0 ** -11}


@dataclass(frozen=True)
class Departure:
    """A row's first token that differs from ar's, and the target's (fp32) top two logits there."""
    row: int           # prompt index
    position: int      # index into the generated tokens
    token: int         # the system's
    ar_token: int      # ar's
    top_logit: float
    gap: float         # top-2 logit gap after prompt + ar's tokens before `position`
    tie: float         # the largest gap called a near tie in the run's dtype

    @property
    def near_tie(self) -> bool:
        return self.gap < self.tie

    def to_dict(self) -> dict:
        return {**asdict(self), "near_tie": self.near_tie}


def tie_threshold(top_logit: float, dtype: str) -> float:
    return NEAR_TIE + RELATIVE_NEAR_TIE[dtype] * abs(top_logit)


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first index where the two differ (a shorter one differs where it ends); None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def top_two(model, tokens: list[int], device: str) -> tuple[float, float]:
    """The model's top logit at the next position and its gap to the second."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0]), float(top[0] - top[1])


def judge(model, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]], dtype: str,
          device: str = "cpu") -> list[Departure]:
    """Each row's first departure from `reference` (ar's outputs), with the target's gap there."""
    found = []
    for row, (prompt, got, want) in enumerate(zip(prompts, outputs, reference)):
        i = first_difference(got, want)
        if i is None or i >= min(len(got), len(want)):
            continue  # equal, or a length difference (an EOS): no token to judge
        top, gap = top_two(model, prompt + want[:i], device)
        found.append(Departure(row, i, got[i], want[i], top, gap, tie_threshold(top, dtype)))
    return found


def judge_cells(cells: list[dict], prompts: list[list[int]], target: str, dtype: str, device: str,
                group: tuple[str, ...] = ("setting", "batch"), rows=lambda cell: cell["outputs"]) -> None:
    """Sets greedy_departures on every greedy cell with an ar cell of the same `group` (a list, empty when
    token-identical; None where either cell failed); rows(cell): its outputs, row i from prompts[i]. Loads the
    target in fp32 only if some cell departs. Logs an error for a departure that is no near tie."""
    key = lambda c: tuple(c[g] for g in group)  # noqa: E731
    ars = {key(c): c for c in cells if c["system"] == "ar" and c["temperature"] == 0}
    pairs = [(c, ars[key(c)]) for c in cells if c["temperature"] == 0 and c["system"] != "ar" and key(c) in ars]
    for c, ar in pairs:
        if c.get("error") or ar.get("error"):  # a failed cell has no outputs to judge, nor to judge by
            c["greedy_departures"] = None
    pairs = [(c, ar) for c, ar in pairs if not c.get("error") and not ar.get("error")]
    model = _load_fp32(target, device) if any(rows(c) != rows(ar) for c, ar in pairs) else None
    for c, ar in pairs:
        found = judge(model, prompts, rows(c), rows(ar), dtype, device) if model is not None else []
        c["greedy_departures"] = [d.to_dict() for d in found]
        for d in found:
            if not d.near_tie:
                log.error("%s %s departs from ar at row %d token %d (%d != %d) where the target is sure: top-2 gap "
                          "%.3g, near tie < %.3g", c["system"], {g: c[g] for g in group}, d.row, d.position, d.token,
                          d.ar_token, d.gap, d.tie)


def _load_fp32(target: str, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()


def summary(cells: list[dict]) -> str | None:
    """One line for the terminal: how many greedy rows departed from ar and whether all at near ties."""
    if not any("greedy_departures" in c for c in cells):
        return None
    judged = [d for c in cells for d in c.get("greedy_departures") or []]  # None: a failed cell, not judged
    if not judged:
        return "greedy: every row token-identical to ar"
    wrong = [d for d in judged if not d["near_tie"]]
    worst = max(d["gap"] / d["tie"] for d in judged)
    verdict = f"{len(wrong)} NOT at a near tie (see the log)" if wrong else "all at near ties of the target's top two logits"
    return f"greedy: {len(judged)} row(s) departed from ar, {verdict}; largest gap / tie {worst:.2f}"
