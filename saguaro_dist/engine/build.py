"""Assemble a one-host engine from a Config: runners, tokenizer, draft side."""
from __future__ import annotations

import logging

import torch

from saguaro_dist.config import Config, DraftExecutor, Mode
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.draft_process import DraftProcess
from saguaro_dist.engine.draft_worker import DraftWorker
from saguaro_dist.engine.engine import Engine
from saguaro_dist.model import ModelRunner, check_same_vocab, load_tokenizer
from saguaro_dist.model.hf_config import load_config
from saguaro_dist.model.loader import resolve_model_dir

log = logging.getLogger(__name__)


def make_runner(path: str, config: Config, tp_group=None, device: str | None = None) -> ModelRunner:
    """A runner on `device` (default: the target's, config.device) with the config's settings."""
    device = device or config.device
    cuda_graphs = device.startswith("cuda") and not config.enforce_eager
    return ModelRunner(path, device=device, dtype=getattr(torch, config.dtype),
                       max_model_len=config.max_model_len, tp_group=tp_group,
                       cuda_graphs=cuda_graphs, max_batch_size=config.max_batch_size, branch_depth=config.k + 1,
                       max_num_batched_tokens=config.max_num_batched_tokens)


def eos_ids(runner, tokenizer) -> set[int]:
    """Every id that ends generation: the model config's eos (int or list) and the tokenizer's."""
    ids = set(runner.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def try_load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a bare checkpoint (then only token-id prompts work)."""
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError) as err:
        log.info("no tokenizer at %s (%s): token-id prompts only", path, err)
        return None


def check_same_tokenizer(target_tok, draft_tok) -> None:
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError("target and draft tokenizers differ: speculative decoding needs one shared vocabulary")


def build_draft_worker(config: Config) -> DraftWorker:
    if config.draft_threads:
        torch.set_num_threads(config.draft_threads)
    def tokenizer():  # for structured outputs, at the first request with a grammar: the draft's, else the target's
        return try_load_tokenizer(config.draft) or try_load_tokenizer(config.model)
    return DraftWorker(config, make_runner(config.draft, config, device=config.draft_device_resolved), tokenizer)


def draft_executor(config: Config) -> DraftExecutor:
    """AUTO resolved. SD's draft and target never run at once: a thread. SSD overlaps them: on the CPU
    its draft gets a process (and a GIL) of its own; on the target's own GPU a thread, whose CUDA
    stream runs beside the target's, where a second process's CUDA context would take turns with the
    target's (docs/benchmarks.md, "GPU, session 23")."""
    if config.draft_executor is not DraftExecutor.AUTO:
        return config.draft_executor
    if config.mode is not Mode.SSD or same_gpu(config.device, config.draft_device_resolved):
        return DraftExecutor.THREAD
    return DraftExecutor.PROCESS


def same_gpu(a: str, b: str) -> bool:
    """Whether two device strings name one CUDA device ("cuda" is device 0 unless set otherwise)."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type == "cuda" and (da.index or 0) == (db.index or 0)


def build_local_draft(config: Config, target: ModelRunner):
    """The draft side of a one-host engine, on a thread or in a child process (config.draft_executor)."""
    if draft_executor(config) is DraftExecutor.THREAD:
        worker = build_draft_worker(config)
        check_same_vocab(target, worker.runner)
        return LocalDraftBackend(worker)
    check_same_vocab(target, load_config(resolve_model_dir(config.draft)))  # fail here, before a child starts
    if config.draft_device_resolved == "cpu" and config.draft_threads is None:
        # A fresh process takes torch's default, every core, beside the target's own threads: on a
        # 2-core box that made rounds ~1.5x as long (docs/benchmark-history.md, session 9).
        log.warning("the SSD draft process will run torch on every core (its default) beside the target's %d "
                    "threads; set draft_threads (and target_threads) to split the cores", torch.get_num_threads())
    return DraftProcess(config)


def build_local_engine(config: Config) -> tuple[Engine, object]:
    """Returns (engine, tokenizer) with the draft on a thread of this process."""
    if config.target_threads:
        torch.set_num_threads(config.target_threads)
    target = make_runner(config.model, config)
    tokenizer = try_load_tokenizer(config.model)
    backend = None
    if config.mode is not Mode.AR:
        check_same_tokenizer(tokenizer, try_load_tokenizer(config.draft))
        backend = build_local_draft(config, target)
    return Engine(config, target, backend, tokenizer, eos_ids(target, tokenizer)), tokenizer
