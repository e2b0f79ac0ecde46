"""`saguaro demo build`: train the demo pair (tokenizer, target, distilled draft) from the stdlib.

Stages, each cached in the work directory so --resume picks up where a run stopped:
corpus split -> BPE tokenizer -> token streams -> target (CE) -> draft (KL on the target's
logits) -> fp16 export to `out/{target,draft}` -> held-out loss and greedy acceptance. The export, prompts
and report are written in a sibling of `out` and swapped in whole, in one atomic step (export.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .export import (LEGACY_STAGE_PREFIX, PAIR_ENTRIES, ROLES, check_swappable, restore_interrupted_swap, save_pair,
                     staged_pair)
from .export import export_pair as export_pair  # re-exported: tests import it from here

log = logging.getLogger(__name__)

PAIR_DIR = Path(__file__).resolve().parent / "pair"
# What --resume picks up from the work dir; a fresh build deletes it first.
STAGE_FILES = ("tokenizer.json", "train_tokens.pt", "heldout_tokens.pt", *(f"{role}.pt" for role in ROLES))
RESUME_HINT = "delete it or build without --resume"
# The batch of step s is drawn from a generator seeded by seed * STRIDE + role offset + s; torch takes
# a seed below 2**64, so MAX_SEED is the largest --seed whose draft batches fit (for runs < STRIDE steps).
BATCH_SEED_STRIDE = 1_000_003
DRAFT_BATCH_OFFSET = 500_000_000
MAX_SEED = (2**64 - 1 - DRAFT_BATCH_OFFSET - BATCH_SEED_STRIDE) // BATCH_SEED_STRIDE


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built pair. Defaults are the shipped pair's recipe."""
    seed: int = 0
    corpus_root: str | None = None  # None: this interpreter's standard library
    max_files: int | None = None
    heldout_percent: int = 5
    vocab_size: int = 2048
    seq_len: int = 512
    batch_size: int = 4  # small batches, many updates: the budget is ~2M tokens
    target_hidden: int = 256
    target_layers: int = 5
    target_heads: int = 4
    target_ffn: int = 688
    draft_hidden: int = 96
    draft_layers: int = 2
    draft_heads: int = 2
    draft_ffn: int = 256
    target_lr: float = 3e-3
    draft_lr: float = 4e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    ce_weight: float = 0.1  # share of plain CE in the draft's loss; the rest is KL to the target
    kd_temperature: float = 1.0
    # None: autocast to bf16 only where the CPU computes it natively (AVX512-BF16/AMX); elsewhere
    # emulated bf16 measured ~15x slower than fp32 (19.5 s vs 1.3 s a target step). Weights stay fp32.
    bf16_autocast: bool | None = None
    target_steps: int | None = 1500
    draft_steps: int | None = 1500
    minutes: float | None = None  # if set, overrides the step counts: a wall-clock budget
    target_share: float = 0.6  # of `minutes`, the part spent on the target
    checkpoint_minutes: float = 3.0
    eval_prompts: int = 20
    eval_new_tokens: int = 64
    eval_k: int = 4
    eval_windows: int = 32
    shipped_prompts: int = 256
    prompt_chars: int = 1000

    def fingerprint(self) -> dict:
        """The fields a checkpoint must agree on to be resumed (budgets and eval may change)."""
        skip = {"target_steps", "draft_steps", "minutes", "target_share", "checkpoint_minutes",
                "eval_prompts", "eval_new_tokens", "eval_k", "eval_windows", "shipped_prompts", "prompt_chars"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


def llama_config(recipe: Recipe, role: str, vocab_size: int, ids: dict):
    from transformers import LlamaConfig

    hidden, layers, heads, ffn = (getattr(recipe, f"{role}_{n}") for n in ("hidden", "layers", "heads", "ffn"))
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=recipe.seq_len, tie_word_embeddings=True,
                       rope_theta=10000.0, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                       pad_token_id=ids["pad"])


def prepare_tokenizer(recipe: Recipe, split, work: Path, resume: bool):
    from . import corpus, tokenizer as tk

    path = work / "tokenizer.json"
    if resume and path.exists():
        return load_cached(path, tk.load_tokenizer)
    tok = tk.train_tokenizer(corpus.read_sources(split.train), recipe.vocab_size)
    write_atomic(path, lambda tmp: tok.save(str(tmp)))
    log.info("tokenizer: %d tokens", tok.get_vocab_size())
    return tok


def prepare_tokens(tok, paths, cache: Path, resume: bool):
    """One flat int32 stream of BOS file EOS BOS file EOS ..., cached in the work dir."""
    import torch

    from . import corpus, tokenizer as tk

    if resume and cache.exists():
        return load_cached(cache, torch.load)
    files = tk.encode_files(tok, corpus.read_sources(paths))
    tokens = torch.tensor([t for ids in files for t in ids], dtype=torch.int32)
    write_atomic(cache, lambda tmp: torch.save(tokens, tmp))
    return tokens


def write_atomic(path: Path, write) -> None:
    # Write then rename: a build killed mid-write leaves no torn file for --resume to trust.
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def load_cached(path: Path, load):
    try:
        return load(path)
    except Exception as err:  # torch and tokenizers report a torn file as a bare RuntimeError/Exception
        raise ValueError(f"{path} is unreadable ({err}); {RESUME_HINT}") from err


def check_recipe_stamp(recipe: Recipe, work: Path, resume: bool) -> None:
    """The work dir's caches belong to one recipe: a resume under another (before any checkpoint, which
    carries its own check) would silently train on the old tokenizer and token streams."""
    path, want = work / "recipe.json", json.loads(json.dumps(recipe.fingerprint()))
    if resume and path.exists() and load_cached(path, lambda p: json.loads(p.read_text())) != want:
        raise ValueError(f"{work} holds a build of a different recipe; {RESUME_HINT}")
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(want, indent=1)))


def drop_stage_files(work: Path) -> None:
    # A fresh build must not leave an earlier run's state behind: the training loops resume any
    # checkpoint they find, and a later --resume would trust stale caches under the new stamp.
    stale = [work / name for name in STAGE_FILES if (work / name).exists()]
    if stale:
        log.warning("discarding an earlier build's state in %s (pass --resume to continue it)", work)
    for path in stale:
        path.unlink()


def writable_dir(path: Path, flag: str) -> None:
    """Create path if needed and prove it takes files: a bad --out must fail now, not after hours of training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as err:
        raise ValueError(f"{flag} {path} is not a writable directory ({err.strerror or err})") from err


def check_out(out: Path) -> None:
    # The export replaces the whole out folder; only a pair folder (or nothing) may go.
    restore_interrupted_swap(out)
    writable_dir(out, "--out")
    for dest in (out / role for role in ROLES):
        # rmtree refuses a symlink (after training) and must not follow one into someone's folder
        replaceable = not dest.is_symlink() and dest.is_dir() and (
            (dest / "config.json").is_file() or not any(dest.iterdir()))
        if (dest.exists() or dest.is_symlink()) and not replaceable:
            raise ValueError(f"--out {out}: {dest} exists and is not a model directory; the export would delete it")
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in PAIR_ENTRIES and not p.name.startswith(LEGACY_STAGE_PREFIX))
    if foreign:
        raise ValueError(f"--out {out} holds more than a demo pair ({', '.join(foreign[:5])}); the export replaces "
                         "the whole folder, so give the pair a folder of its own")
    check_swappable(out)


def special_ids(tok) -> dict:
    from . import tokenizer as tk

    return {"bos": tok.token_to_id(tk.BOS), "eos": tok.token_to_id(tk.EOS), "pad": tok.token_to_id(tk.PAD)}


def loop_spec(recipe: Recipe, role: str, work: Path, steps: int | None, budget_s: float | None,
              teacher: dict | None = None):
    """`teacher` (the draft's): the target it is distilled from; a draft.pt of another target restarts."""
    from .train import LoopSpec

    extra = {"role": role} | ({"teacher": teacher} if teacher else {})
    return LoopSpec(role=role, ckpt=work / f"{role}.pt", total_steps=None if budget_s else steps,
                    budget_s=budget_s, lr=getattr(recipe, f"{role}_lr"), warmup=recipe.warmup_steps,
                    weight_decay=recipe.weight_decay, checkpoint_s=recipe.checkpoint_minutes * 60,
                    seed=recipe.seed, fingerprint=recipe.fingerprint() | extra,
                    bf16=native_bf16() if recipe.bf16_autocast is None else recipe.bf16_autocast,
                    restart_on=("teacher",) if teacher else ())


def native_bf16() -> bool:
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def budgets(recipe: Recipe) -> tuple[float | None, float | None]:
    if not 0 < recipe.target_share < 1:  # 1.0 gave the draft a 0 s budget: a ZeroDivisionError after the target
        raise ValueError(f"target_share must be between 0 and 1 (exclusive), got {recipe.target_share}")
    if recipe.minutes is None:
        return None, None
    if not (math.isfinite(recipe.minutes) and recipe.minutes > 0):
        raise ValueError("--minutes must be a positive number")
    total = recipe.minutes * 60
    return total * recipe.target_share, total * (1 - recipe.target_share)


def batch_fn(recipe: Recipe, tokens, role_offset: int):
    from .train import sample_batch

    if len(tokens) <= recipe.seq_len + 1:
        raise ValueError(f"training stream has {len(tokens)} tokens; need more than seq_len + 1 = {recipe.seq_len + 1}")
    base = recipe.seed * BATCH_SEED_STRIDE + role_offset
    return lambda step: sample_batch(tokens, recipe.batch_size, recipe.seq_len, base + step)


def train_models(recipe: Recipe, tokens, config_t, config_d, work: Path) -> dict:
    """Train the target, then distil the draft from it; returns both models and their step counts."""
    import torch
    from transformers import LlamaForCausalLM

    from .train import distill_loss, run_loop, target_loss, weights_digest

    target_budget, draft_budget = budgets(recipe)
    torch.manual_seed(recipe.seed)
    target = LlamaForCausalLM(config_t)
    draft = LlamaForCausalLM(config_d)
    t_steps = run_loop(target, target_loss, batch_fn(recipe, tokens, 0),
                       loop_spec(recipe, "target", work, recipe.target_steps, target_budget))
    for p in target.parameters():
        p.requires_grad_(False)
    loss = distill_loss(target, recipe.ce_weight, recipe.kd_temperature)
    teacher = {"steps": t_steps, "sha256": weights_digest(target)}  # a resume that trains the target on retrains the draft
    d_steps = run_loop(draft, loss, batch_fn(recipe, tokens, DRAFT_BATCH_OFFSET),
                       loop_spec(recipe, "draft", work, recipe.draft_steps, draft_budget, teacher))
    return {"target": target, "draft": draft, "target_steps": t_steps, "draft_steps": d_steps}


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def measure(recipe: Recipe, out: Path, heldout_tokens, prompts: list[str]) -> dict:
    """Reload the exported fp16 pair (exactly what ships, still staged) and measure it in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluate import greedy_acceptance, heldout_loss

    tok = AutoTokenizer.from_pretrained(out / "target")
    target, draft = (AutoModelForCausalLM.from_pretrained(out / r, dtype=torch.float32).eval() for r in ("target", "draft"))
    keep = recipe.seq_len - recipe.eval_new_tokens
    ids = [tok(p)["input_ids"][-keep:] for p in prompts[:recipe.eval_prompts]]
    return {
        "heldout_loss": {r: heldout_loss(m, heldout_tokens, recipe.seq_len, recipe.eval_windows)
                         for r, m in (("target", target), ("draft", draft))},
        "greedy": greedy_acceptance(target, draft, ids, recipe.eval_k, recipe.eval_new_tokens, tok.eos_token_id),
    }


def build_report(recipe: Recipe, split, train_tokens, heldout_tokens, models: dict) -> dict:
    return {"recipe": dataclasses.asdict(recipe), "files": {"train": len(split.train), "heldout": len(split.heldout)},
            "tokens": {"train": len(train_tokens), "heldout": len(heldout_tokens)},
            "params": {r: count_params(models[r]) for r in ROLES},
            "steps": {r: models[f"{r}_steps"] for r in ROLES}}


def check_recipe(recipe: Recipe) -> None:
    """Values that otherwise fail only after the tokenizer and token caches are built (minutes in)."""
    if isinstance(recipe.seed, bool) or not isinstance(recipe.seed, int) or not 0 <= recipe.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer from 0 to {MAX_SEED}, got {recipe.seed}")
    budgets(recipe)


def check_separate(out: Path, work: Path) -> None:
    # The export swaps out in whole: work caches in it would go, and its files would block the next --resume.
    out, work = out.resolve(), work.resolve()
    if out == work or out in work.parents or work in out.parents:
        raise ValueError(f"--out {out} and --work {work} overlap; give the pair and the build scratch "
                         "separate folders (neither inside the other)")


def prepare_work_dir(recipe: Recipe, out: Path, work: Path, resume: bool) -> None:
    """Every check that can fail cheaply, before hours of training: the recipe, the folders, and the recipe a
    resume continues. Without --resume, the stage files of an earlier build are dropped (a fresh start)."""
    check_recipe(recipe)
    check_separate(out, work)
    writable_dir(work, "--work")
    check_out(out)
    if not resume:
        drop_stage_files(work)
    elif not (work / "recipe.json").exists():  # a mistyped --work would silently start over
        log.warning("--resume: %s holds nothing to resume (no recipe.json); building from scratch", work)
    check_recipe_stamp(recipe, work, resume)


def single_threaded(seed: int) -> None:
    """One thread, seeded: the demo build must leave the machine's other cores to everyone else."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(seed)


def split_with_prompts(recipe: Recipe):
    """The corpus split into train and held-out files, and the shipped prompts drawn from the held-out ones:
    before training, so that a held-out set with no prompt that fits prompt_chars fails now, not after hours."""
    from . import corpus

    split = corpus.split_corpus(recipe.corpus_root, recipe.heldout_percent, recipe.max_files)
    prompts = corpus.sample_snippets(corpus.read_sources(split.heldout), recipe.shipped_prompts,
                                     recipe.prompt_chars, recipe.seed)
    return split, prompts


def train_pair(recipe: Recipe, tok, train_tokens, work: Path) -> dict:
    """The target and the draft, trained on one tokenizer's vocabulary and special ids (a pair must share them)."""
    ids, vocab = special_ids(tok), tok.get_vocab_size()
    return train_models(recipe, train_tokens, llama_config(recipe, "target", vocab, ids),
                        llama_config(recipe, "draft", vocab, ids), work)


def build(recipe: Recipe, out: Path | str = PAIR_DIR, work: Path | str = ".demo-build", resume: bool = False) -> dict:
    """Build the pair into `out`; returns the build report (also written to out/build_info.json)."""
    from .tokenizer import wrap_fast

    started = time.monotonic()
    out, work = Path(out).resolve(), Path(work)  # resolved: a symlinked out stays a link to the swapped folder
    prepare_work_dir(recipe, out, work, resume)
    single_threaded(recipe.seed)
    split, prompts = split_with_prompts(recipe)
    tok = prepare_tokenizer(recipe, split, work, resume)
    train_tokens = prepare_tokens(tok, split.train, work / "train_tokens.pt", resume)
    heldout_tokens = prepare_tokens(tok, split.heldout, work / "heldout_tokens.pt", resume)
    models = train_pair(recipe, tok, train_tokens, work)
    with staged_pair(out) as stage:  # the pair, its prompts and its report appear together, or not at all
        save_pair(models, wrap_fast(tok, recipe.seq_len), stage)
        (stage / "prompts.json").write_text(json.dumps(prompts, indent=1))
        report = build_report(recipe, split, train_tokens, heldout_tokens, models)
        report |= measure(recipe, stage, heldout_tokens, prompts)
        report["build_minutes"] = (time.monotonic() - started) / 60
        (stage / "build_info.json").write_text(json.dumps(report, indent=1))
    log.info("exported the pair to %s", out)
    return report
