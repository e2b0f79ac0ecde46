"""Training loops: the target on next-token CE, the draft distilled from the target's logits.

Both loops are resumable: the model, optimiser and step are checkpointed every few minutes, and
the batch of step s is drawn from a generator seeded by (seed, role, s), so a resumed run sees
exactly the batches an uninterrupted one would. With a wall-clock budget (`--minutes`) the LR
schedule follows training time instead of steps, so a run on a busy machine still ends on time, and no
run repeats it: the steps it ran are reported, and passing them as --steps gives a deterministic run of
that length on the same batches, whose step-based schedule ends on nearby weights, not the same ones.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

@dataclass
class LoopSpec:
    """What one training loop needs besides the model (internal to the recipe, not a config)."""
    role: str
    ckpt: Path
    total_steps: int | None  # used when budget_s is None
    budget_s: float | None  # a wall-clock budget: the schedule follows time, not steps
    lr: float
    warmup: int
    weight_decay: float
    checkpoint_s: float
    seed: int
    fingerprint: dict
    bf16: bool = False  # autocast matmuls to bf16 (about 2x faster on CPUs with avx512_bf16/AMX)
    # fingerprint keys whose change restarts the loop from step 0 instead of refusing the checkpoint:
    # the draft's teacher, which a resume may have trained further
    restart_on: tuple[str, ...] = ()


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max(0.0, progress))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def progress_of(spec: "LoopSpec", step: int, elapsed_s: float) -> float:
    """Fraction of the run done: by steps, or (with a minutes budget) by training wall-clock time."""
    if spec.budget_s is not None:
        return elapsed_s / spec.budget_s
    return (step - spec.warmup) / max(1, spec.total_steps - spec.warmup)


def target_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def distill_loss(teacher, ce_weight: float, temperature: float) -> Callable:
    """KL(teacher || student) on the teacher's logits, mixed with a little CE on the real text."""
    def loss_fn(student, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float() / temperature, -1)
        logits = student(input_ids=inputs).logits.float()
        student_logp = F.log_softmax(logits / temperature, -1)
        kl = F.kl_div(student_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True,
                      reduction="batchmean") * temperature ** 2
        ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        return (1 - ce_weight) * kl + ce_weight * ce
    return loss_fn


CHECKPOINT_KEYS = frozenset({"model", "opt", "step", "elapsed_s", "fingerprint"})


def save_checkpoint(spec: LoopSpec, model, opt, step: int, elapsed_s: float) -> None:
    tmp = spec.ckpt.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "elapsed_s": elapsed_s, "fingerprint": spec.fingerprint}, tmp)
    os.replace(tmp, spec.ckpt)  # atomic: a kill mid-save never leaves a torn checkpoint


def load_checkpoint(spec: LoopSpec, model, opt) -> tuple[int, float]:
    if not spec.ckpt.exists():
        return 0, 0.0
    state = read_checkpoint(spec.ckpt)
    if state["fingerprint"] != spec.fingerprint:
        if without(state["fingerprint"], spec.restart_on) != without(spec.fingerprint, spec.restart_on):
            raise ValueError(f"{spec.ckpt} was written by a different recipe; delete it or build without --resume")
        changed = [k for k in spec.restart_on if state["fingerprint"].get(k) != spec.fingerprint[k]]
        log.warning("%s: %s was trained against another %s; restarting it from step 0",
                    spec.role, spec.ckpt, " and ".join(changed))
        return 0, 0.0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    log.info("%s: resuming at step %d", spec.role, state["step"])
    return state["step"], state["elapsed_s"]


def without(fingerprint: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in fingerprint.items() if k not in keys}


def weights_digest(model) -> str:
    """sha256 of the model's weights: names a trained model exactly (a resumed run reproduces it bit for bit)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch reports a torn file as a bare RuntimeError/EOFError/UnpicklingError
        raise ValueError(f"{path} is unreadable ({err}); delete it or build without --resume") from err
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise ValueError(f"{path} is not a demo-build checkpoint; delete it or build without --resume")
    return state


def make_optimizer(model, spec: LoopSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)


def train_step(model, opt, loss_fn: Callable, batch: torch.Tensor, lr: float, bf16: bool) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run_loop(model, loss_fn: Callable, batches: Callable[[int], torch.Tensor], spec: LoopSpec) -> int:
    """Train until total_steps, or until budget_s of training time; returns the steps run."""
    from tqdm.auto import tqdm

    opt = make_optimizer(model, spec)
    step, elapsed = load_checkpoint(spec, model, opt)
    model.train()
    last_save = time.monotonic()
    bar = tqdm(initial=step, total=spec.total_steps if spec.budget_s is None else None,
               desc=f"train {spec.role}", unit="step")
    while (progress := progress_of(spec, step, elapsed)) < 1.0 and (spec.budget_s or step < spec.total_steps):
        started = time.monotonic()
        loss = train_step(model, opt, loss_fn, batches(step),
                          lr_at(step, progress, spec.lr, spec.warmup), spec.bf16)
        step, elapsed = step + 1, elapsed + time.monotonic() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", done=f"{min(1.0, max(0.0, progress)):.0%}")  # < 0 in warm-up
        if time.monotonic() - last_save > spec.checkpoint_s:
            save_checkpoint(spec, model, opt, step, elapsed)
            last_save = time.monotonic()
    bar.close()
    save_checkpoint(spec, model, opt, step, elapsed)
    model.eval()
    return step
