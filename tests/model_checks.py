"""What the model-runtime tests share: tiny checkpoints made to expose attention bugs, token streams, logits
read from transformers and from our runner along the decode path, and the checks each model family runs with
them (every attention path, greedy ar / sd / ssd, 2 tensor-parallel ranks)."""
from __future__ import annotations

import torch
from engine_helpers import DEVICE, assert_greedy_equal, hf_greedy
from test_step_graphs import static_runner, steps
from tp_ranks import runner_logits, two_rank_logits  # noqa: F401 (the model tests take them from here)
from transformers import AutoModelForCausalLM

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model.runner import ModelRunner

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


# ---- the checks every model family runs: logits on each attention path, greedy generation, 2 TP ranks ----
ATOL = 1e-5


def save_perturbed_draft(path, source, seed: int, noise: float = 0.15) -> None:
    """A draft of the same family and vocabulary, close to the target: its weights plus relative noise."""
    gen = torch.Generator().manual_seed(seed)
    clone = type(source)(source.config).eval()
    with torch.no_grad():
        for p, q in zip(clone.parameters(), source.parameters()):
            p.copy_(q + noise * q.std() * torch.randn(q.shape, generator=gen))
    clone.save_pretrained(path)


def perturbed_pair(root, model) -> dict:
    """The target `model` (saved at root / "target") and a perturbed draft of it: what the greedy checks take."""
    save_perturbed_draft(root / "draft", model, seed=1)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model}


def check_logits(path, model, seq: list[int], atol: float = ATOL, **runner_kw) -> None:
    """runner_logits (half prefilled, whole or in chunks of max_num_batched_tokens, the rest decoded) as
    transformers' `model` computes them."""
    got = runner_logits(ModelRunner(path, **runner_kw), seq)
    torch.testing.assert_close(got, hf_logits(model, seq), atol=atol, rtol=0)


def check_bf16_prefill_bitwise(path, seq: list[int]) -> None:
    """A whole prompt in bf16, bit for bit transformers' bf16 load of the same checkpoint."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runner = ModelRunner(path, dtype=torch.bfloat16)
    runner.add("s")
    torch.testing.assert_close(runner.extend(["s"], [seq], [len(seq)])[0], hf_logits(hf, seq), atol=0, rtol=0)


def check_batched_extends(path, model, seqs: list[list[int]], cuts: list[list[int]], prompt_rows: bool = False,
                          atol: float = ATOL) -> None:
    """The sequences fed together, split at their `cuts` (one batched extend a piece: rows at different positions
    in one forward). Every later piece's rows checked against transformers; the first's too with prompt_rows
    (whole prompts from position 0), else it returns one row each, unchecked."""
    runner, ids = ModelRunner(path), [chr(ord("a") + i) for i in range(len(seqs))]
    for sid in ids:
        runner.add(sid)
    pieces = [[s[a:b] for a, b in zip([0, *c], [*c, len(s)])] for s, c in zip(seqs, cuts)]
    rows = [[] for _ in seqs]
    for stage, piece in enumerate(zip(*pieces)):
        checked = bool(stage) or prompt_rows
        got = runner.extend(ids, list(piece), [len(p) if checked else 1 for p in piece])
        for kept, new in zip(rows, got if checked else ()):
            kept.append(new)
    for seq, kept in zip(seqs, map(torch.cat, rows)):
        torch.testing.assert_close(kept, hf_logits(model, seq)[-len(kept):], atol=atol, rtol=0)


def check_branch_steps(runner, model, prefixes: dict[str, list[int]], seq_ids: list[str], paths: list[list[int]],
                       atol: float = ATOL) -> None:
    """Branches over stored prefixes (branch i over seq_ids[i]'s, taking paths[i]), stepped along their paths:
    each step's logits transformers' for the prefix + the path so far."""
    for sid, prefix in prefixes.items():
        runner.add(sid)
        runner.extend([sid], [prefix], [1])
    starts = [len(prefixes[sid]) for sid in seq_ids]
    state, got = runner.branch_start(seq_ids, starts, torch.tensor([p[0] for p in paths]))
    for depth in range(len(paths[0])):
        if depth:
            got = runner.branch_step(state, torch.tensor([p[depth] for p in paths]))
        want = torch.stack([hf_logits(model, prefixes[sid] + p[:depth + 1])[-1] for sid, p in zip(seq_ids, paths)])
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def check_two_branches(path, model, prefix: list[int]) -> None:
    """Two branches over one prefix, three steps (3 40 5 and 11 40 62: a token both take at one depth)."""
    check_branch_steps(ModelRunner(path), model, {"s": prefix}, ["s", "s"], [[3, 40, 5], [11, 40, 62]])


def check_static_steps(path, atol: float = ATOL) -> None:
    """test_step_graphs' steps on the static (CUDA-graph) layouts, run uncaptured: the eager runner's logits."""
    got, want = steps(static_runner(path)), steps(ModelRunner(path))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def check_greedy_generation(pair: dict, mode: str, prompt: list[int], n: int) -> None:
    """LLM.generate at temperature 0 in `mode` (ar, or sd / ssd with pair's draft, k 3): transformers' generate."""
    want = hf_greedy(pair["model"], prompt, n)
    speculative = {} if mode == "ar" else {"draft": pair["draft"], "k": 3, "draft_executor": "thread"}
    with LLM(device=DEVICE, model=pair["target"], mode=mode, max_batch_size=1, **speculative) as llm:
        got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    assert_greedy_equal(list(got), want, prompt, pair["model"])


# ---- tensor parallel: 2 gloo ranks in spawned processes --------------------------------------------------
def check_two_ranks_match_transformers(path, model, seq: list[int], atol: float = ATOL) -> None:
    """Rank 0's logits transformers', rank 1's rank 0's to the bit."""
    got = two_rank_logits(path, seq)
    torch.testing.assert_close(got[0], hf_logits(model, seq), atol=atol, rtol=0)
    torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)
