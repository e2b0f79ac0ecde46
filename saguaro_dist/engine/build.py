"""Assemble a one-host engine from a Config: runners, tokenizer, draft side."""
from __future__ import annotations

import logging

import torch

from saguaro_dist.config import Config, Mode
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.draft_worker import DraftWorker
from saguaro_dist.engine.engine import Engine
from saguaro_dist.model import ModelRunner, check_same_vocab, load_tokenizer

log = logging.getLogger(__name__)


def make_runner(path: str, config: Config, tp_group=None) -> ModelRunner:
    return ModelRunner(path, device=config.device, dtype=getattr(torch, config.dtype),
                       max_model_len=config.max_model_len, tp_group=tp_group)


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
    return DraftWorker(config, make_runner(config.draft, config))


def build_local_engine(config: Config) -> tuple[Engine, object]:
    """Returns (engine, tokenizer) with the draft on a thread of this process."""
    if config.target_threads:
        torch.set_num_threads(config.target_threads)
    target = make_runner(config.model, config)
    tokenizer = try_load_tokenizer(config.model)
    backend = None
    if config.mode is not Mode.AR:
        worker = build_draft_worker(config)
        check_same_vocab(target, worker.runner)
        check_same_tokenizer(tokenizer, try_load_tokenizer(config.draft))
        backend = LocalDraftBackend(worker)
    return Engine(config, target, backend, tokenizer, eos_ids(target, tokenizer)), tokenizer
