"""Assemble a one-host engine from a Config: runners, tokenizer, draft side."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from saguaro_dist.config import Config, DraftExecutor, Mode
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.draft_process import DraftProcess
from saguaro_dist.engine.draft_worker import DraftWorker
from saguaro_dist.model import ModelRunner, load_tokenizer
from saguaro_dist.model.hf_config import ModelConfig, load_config
from saguaro_dist.model.loader import TOKENIZER_FILES, resolve_model_dir
from saguaro_dist.model.runner_args import check_max_model_len
from saguaro_dist.model.vocab import check_pair_vocab

if TYPE_CHECKING:
    from saguaro_dist.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftFit:
    """What the draft is built to: the target's vocabulary, and the longest sequence it holds."""
    vocab_size: int      # the target's (a draft's own may differ by padding rows, model/vocab.py)
    max_model_len: int   # the engine's, or the draft's own context when shorter (then the fast backup goes on)
    # The draft's config.json as fit_draft parsed it: its runner (in a child process or a Ray actor too) need
    # not parse it again, which imports transformers for the class defaults (~2.5 CPU s of a child's ~5)
    draft_config: ModelConfig | None = field(default=None, compare=False, repr=False)
    # The target's eos ids (eos_ids: generation_config.json's list and the tokenizer's): the draft's grammars
    # end where the target's do (Llama 3's <|eot_id|>, Qwen's <|im_end|>), not at its tokenizer's EOS alone
    eos_token_ids: tuple[int, ...] = ()


def position_slack(config: Config, draft: bool = False) -> int:
    """A runner's KV and RoPE positions past max_model_len. The target's: a speculative round scores K + 1
    positions past the last token, so at the context's end some past max_model_len; their tokens are cut
    (finish "length"), and every kept one reads only positions before it, so the modes fill the whole context
    exactly, as AR. The draft's: a tree's branch reaches K + 1 tokens past a sequence (K accepted and the
    bonus), then K draft tokens more, so a sequence keeps its draft up to max_model_len (sd_loop _draft_room)."""
    return 0 if config.mode is Mode.AR else (2 if draft else 1) * (config.k + 1)


def make_runner(path: str, config: Config, tp_group=None, device: str | None = None,
                fit: DraftFit | None = None, revision: str | None = None, lora: bool = False,
                slack: int = 0) -> ModelRunner:
    """A runner on `device` (default: the target's, config.device) with the config's settings; a draft's
    `fit` sets the vocabulary it speaks and the longest sequence it holds (fit_draft). lora: the target's,
    with config.max_loras adapter slots under enable_lora (the draft has none: it drafts for the base model,
    and the target's verify with the adapter keeps outputs exact). slack: the target's position_slack."""
    device = device or config.device
    loras = dict(max_loras=config.max_loras if lora and config.enable_lora else 0, max_lora_rank=config.max_lora_rank)
    cuda_graphs = device.startswith("cuda") and not config.enforce_eager
    return ModelRunner(path, device=device, dtype=config.dtype,  # "auto": this checkpoint's, for this device
                       model_config=fit.draft_config if fit else None,
                       max_model_len=fit.max_model_len if fit else config.max_model_len, tp_group=tp_group,
                       cuda_graphs=cuda_graphs, max_batch_size=config.max_batch_size, branch_depth=config.k + 1,
                       max_num_batched_tokens=config.max_num_batched_tokens, vocab_size=fit.vocab_size if fit else None,
                       revision=revision, gpu_memory_utilization=config.gpu_memory_utilization,
                       position_slack=slack, **loras)


def eos_ids(runner, tokenizer, config: Config | None = None) -> set[int]:
    """Every id that ends generation: the generation config's eos (generation_eos_ids; without `config`,
    config.json's) and the tokenizer's. The engine ends at the tokenizer's with no stop_reason and at the
    others as vLLM's stop_token_ids (Engine._check_stop)."""
    generation = generation_eos_ids(config) if config is not None else None
    return with_tokenizer_eos(runner.config.eos_token_ids if generation is None else generation, tokenizer)


def with_tokenizer_eos(ids, tokenizer) -> set[int]:
    """ids and the tokenizer's EOS (if it has one)."""
    ids = set(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generation_eos_ids(config: Config) -> tuple[int, ...] | None:
    """The eos_token_id (an id or a list) of the generation_config.json vLLM reads for it: the folder
    config.generation_config names, else the model's own ("vllm" too: only sampling defaults are off then).
    None where there is no file: config.json's eos stands in (transformers' GenerationConfig.from_model_config);
    () for a file that names none (vLLM then adds no stop ids)."""
    source = config.generation_config
    own = source in ("auto", "vllm")
    folder = resolve_model_dir(config.model if own else source, weights=False, revision=config.revision if own else None)
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    eos = json.loads(path.read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id >= 0 or a list of them, got {eos!r}")
    return tuple(ids)


def try_load_tokenizer(path: str, revision: str | None = None):
    """The checkpoint's tokenizer, or None for a bare checkpoint (then only token-id prompts work)."""
    try:
        return load_tokenizer(path, revision)
    except (OSError, ValueError, TypeError) as err:
        log.info("no tokenizer at %s (%s): token-id prompts only", path, err)
        return None


def target_tokenizer(config: Config):
    """The tokenizer the engine speaks: config.tokenizer when named (then failing to load it is an error,
    not a bare checkpoint's token-id-only mode), else the target checkpoint's own, if it ships one."""
    path, revision = config.tokenizer_source
    if config.tokenizer is None:
        return try_load_tokenizer(path, revision)
    try:
        tokenizer = load_tokenizer(path, revision)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"tokenizer {path!r} could not be loaded: {err}") from None
    if tokenizer is None:
        raise ValueError(f"tokenizer {path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return tokenizer


def draft_tokenizer(config: Config, target_tok):
    """The draft checkpoint's own tokenizer; a draft that ships none beside a named tokenizer is taken to
    speak that one (naming one tokenizer for the pair says so, as vLLM's --tokenizer does)."""
    own = try_load_tokenizer(config.draft, config.draft_revision)
    return target_tok if own is None and config.tokenizer is not None else own


def fit_draft(config: Config, target_tok) -> DraftFit:
    """Check that the pair shares one vocabulary (the same tokenizer; embedding sizes that differ only by
    padding are matched) and size the draft, from config.json and the tokenizers only: a bad pair fails
    before any weights load, and on Ray before any actor starts."""
    target, draft = (load_config(resolve_model_dir(p, weights=False, revision=r))
                     for p, r in ((config.model, config.revision), (config.draft, config.draft_revision)))
    check_pair_vocab(target.vocab_size, draft.vocab_size, target_tok, draft_tokenizer(config, target_tok))
    wanted = config.max_model_len or target.max_position_embeddings
    check_max_model_len(wanted, target)  # the target's runner would refuse it, on Ray after the drafts load
    if draft.max_position_embeddings < wanted:
        log.info("the draft's context is %d tokens, the engine's %d: longer sequences go on with the fast "
                 "(n-gram) backup instead of the draft", draft.max_position_embeddings, wanted)
    generation = generation_eos_ids(config)
    ends = with_tokenizer_eos(target.eos_token_ids if generation is None else generation, target_tok)
    return DraftFit(target.vocab_size, min(wanted, draft.max_position_embeddings), draft, tuple(sorted(ends)))


def build_draft_worker(config: Config, fit: DraftFit | None = None, device: str | None = None) -> DraftWorker:
    """fit: from fit_draft (None: the draft's own vocabulary, and config.max_model_len); device: default
    config.draft_device_resolved. It leaves torch's threads alone: they are the process's, and a draft in
    the target's process shares the target's (a process of the draft's own sets config.draft_threads)."""
    def tokenizer():  # for structured outputs, at the first request with a grammar: the draft's, else the target's
        return try_load_tokenizer(config.draft, config.draft_revision) or target_tokenizer(config)
    runner = make_runner(config.draft, config, device=device or config.draft_device_resolved, fit=fit,
                         revision=config.draft_revision, slack=position_slack(config, draft=True))
    return DraftWorker(config, runner, tokenizer, eos_token_ids=fit.eos_token_ids if fit else ())


def draft_executor(config: Config) -> DraftExecutor:
    """AUTO resolved. SD's draft and target never run at once: a thread. SSD overlaps them. A draft on the
    CPU builds its trees in a process of its own and drafts just in time on a thread, as SD does (split:
    docs/architecture.md): a thread's tree build would take the target's GIL. A draft on the target's own
    GPU runs on a thread with a CUDA stream of its own: two processes' kernels take turns on one GPU, and
    on an H200 (session 65) the thread ran faster than split in all 8 bench cells (inflated target b = 8,
    T = 0.7: 2243 tok/s against 872). Session 64 had made split that default after a thread broke
    exactness there; the cause, graphs of both models captured on one stream and so sharing a cuBLAS
    workspace, is fixed (model/cuda_graphs.py: CaptureStreams) and the two failing tests passed in 7 runs
    of 7 (docs/benchmarks.md, "GPU, session 65"). A draft on another GPU: a process."""
    if config.draft_executor is not DraftExecutor.AUTO:
        return config.draft_executor
    if config.mode is not Mode.SSD:
        return DraftExecutor.THREAD
    draft_device = config.draft_device_resolved
    if torch.device(draft_device).type == "cpu":
        return DraftExecutor.SPLIT
    return DraftExecutor.THREAD if same_gpu(config.device, draft_device) else DraftExecutor.PROCESS


def ray_draft_executor(config: Config) -> DraftExecutor:
    """AUTO resolved on Ray: SPLIT (the target's rank 0 drafts just in time on its own draft copy, the
    pool builds the trees) for SSD on the CPU, as one host does; else PROCESS (the pool does all). Why on
    the CPU: a draft over gRPC waited 3.7 ms a round where the copy drafts in 2.5 (b = 1, T = 0.7)."""
    if config.draft_executor is not DraftExecutor.AUTO:
        return config.draft_executor
    on_cpu = torch.device(config.device).type == "cpu"
    return DraftExecutor.SPLIT if config.mode is Mode.SSD and on_cpu else DraftExecutor.PROCESS


def same_gpu(a: str, b: str) -> bool:
    """Whether two device strings name one CUDA device ("cuda" is device 0 unless set otherwise)."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type == "cuda" and (da.index or 0) == (db.index or 0)


def shared_gpu_advice(config: Config) -> str | None:
    """What to tell a user whose SSD draft shares the target's GPU (None otherwise): exact, but the trees
    then compete with the verify for one device."""
    if config.mode is not Mode.SSD or not same_gpu(config.device, config.draft_device_resolved):
        return None
    return (f"SSD's draft shares the target's GPU ({config.device}): its trees compete with the verify for the "
            "device, and on an H200 such SSD ran 0.50-0.99x SD (docs/benchmarks.md, \"GPU, session 65\"); SSD "
            "wants a device of its own for the draft (draft_device, --draft-device cuda:1)")


def build_local_draft(config: Config, fit: DraftFit):
    """The draft side of a one-host engine: on a thread, in a child process, or split between the two
    (config.draft_executor)."""
    if advice := shared_gpu_advice(config):
        log.info(advice)
    executor = draft_executor(config)
    if executor is DraftExecutor.THREAD:
        return LocalDraftBackend(build_draft_worker(config, fit))
    if config.draft_device_resolved == "cpu" and config.draft_threads is None:
        # A fresh process takes torch's default, every core, beside the target's own threads: on a
        # 2-core box that made rounds ~1.5x as long (docs/benchmark-history.md, session 9).
        log.warning("the SSD draft process will run torch on every core (its default) beside the target's %d "
                    "threads; set draft_threads (and target_threads) to split the cores", torch.get_num_threads())
    trees = DraftProcess(config, fit)  # first: a draft that cannot load fails here, with the child's clear error
    if executor is DraftExecutor.SPLIT:
        # here, not at the top: the draft's child process imports this module for build_draft_worker alone
        from saguaro_dist.engine.split_draft import SplitDraftBackend
        try:
            return SplitDraftBackend(LocalDraftBackend(build_draft_worker(config, fit)), trees)
        except BaseException:
            trees.close()
            raise
    return trees


def build_local_engine(config: Config) -> tuple[Engine, object]:
    """Returns (engine, tokenizer) with the draft on a thread of this process."""
    from saguaro_dist.engine.engine import Engine  # here: the draft's child imports this module, never the loop
    if config.target_threads:
        torch.set_num_threads(config.target_threads)
    tokenizer = target_tokenizer(config)
    fit = fit_draft(config, tokenizer) if config.uses_draft else None
    target = make_runner(config.model, config, revision=config.revision, lora=True, slack=position_slack(config))
    backend = build_local_draft(config, fit) if fit else None
    return Engine(config, target, backend, tokenizer, eos_ids(target, tokenizer, config)), tokenizer
