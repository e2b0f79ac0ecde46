"""ModelRunner: one model plus the KV state of many sequences (the contract in docs/architecture.md)."""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from saguaro_dist.config import check_memory_utilization
from saguaro_dist.model.branch import BranchBatch, BranchState, end_branches, new_branch_state
from saguaro_dist.model.build import build_model
from saguaro_dist.model.cuda_graphs import StepGraphs, graph_refusal
from saguaro_dist.model.device import resolve_device
from saguaro_dist.model.extend_batch import ExtendBatch
from saguaro_dist.model.hf_config import ModelConfig, load_config
from saguaro_dist.model.kv_cache import MIN_KV_CAPACITY, NARROW_ABOVE, KVPool
from saguaro_dist.model.loader import resolve_model_dir
from saguaro_dist.model.lora import LoRASlots, enable_lora, lora_tokens
from saguaro_dist.model.lora_adapter import LoRAAdapter, load_adapter
from saguaro_dist.model.memory import KVNeed, check_kv_fits, kv_bytes_per_token
from saguaro_dist.model.pretranspose import pretranspose_linears
from saguaro_dist.model.rope import model_rope_tables
from saguaro_dist.model.runner_args import check_max_model_len, checked_batched_tokens, runner_dtype
from saguaro_dist.model.vocab import match_vocab


class ModelRunner:
    def __init__(self, path_or_hf_id, *, device="cpu", dtype=torch.float32, max_model_len=None, tp_group=None,
                 cuda_graphs=False, max_batch_size=8, branch_depth=8, max_num_batched_tokens=2048, vocab_size=None,
                 revision=None, gpu_memory_utilization=0.9, preallocate_kv=None, max_loras=0, max_lora_rank=16,
                 model_config: ModelConfig | None = None, position_slack: int = 0):
        """dtype: a torch.dtype, its name, or "auto" (this checkpoint's, for this device: model/device.py
        auto_dtype). vocab_size: the ids this runner takes and scores, when not its checkpoint's own (a draft
        matched to its target's padded vocabulary, model/vocab.py). revision: a Hub id's branch, tag or commit.
        preallocate_kv: allocate the KV pool's worst case now, failing if it does not fit the memory
        gpu_memory_utilization allows (None: on CUDA; else it grows on demand); model/memory.py. max_loras: LoRA
        adapter slots (0: LoRA off, no op added), each of rank up to max_lora_rank (load_lora, add's lora_slot).
        model_config: load_config's parse of this checkpoint when the caller has it (a draft's DraftFit).
        position_slack: KV and RoPE positions a sequence may hold past max_model_len (a speculative target's
        K + 1: a round at the context's end scores positions whose tokens the engine then cuts)."""
        model_dir = resolve_model_dir(path_or_hf_id, revision=revision)
        self.config = cfg = model_config or load_config(model_dir)
        self.vocab_size = vocab_size or cfg.vocab_size
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        check_max_model_len(self.max_model_len, cfg)
        if type(position_slack) is not int or position_slack < 0:
            raise ValueError(f"position_slack must be an integer >= 0, got {position_slack!r}")
        # The slack may pass max_position_embeddings: RoPE is arithmetic there, and a token emitted at position q
        # reads only positions < q, so no token the engine keeps (all < max_model_len) sees a slack position.
        self.max_positions = self.max_model_len + position_slack  # what one sequence's KV may hold
        self.device = resolve_device(device)
        self.dtype = runner_dtype(path_or_hf_id, dtype, cfg, self.device)
        self.max_num_batched_tokens = checked_batched_tokens(max_num_batched_tokens)
        check_memory_utilization(gpu_memory_utilization)
        with torch.inference_mode():
            kv_heads = self._load_model(model_dir, tp_group)
            self.lora = self._lora_slots(max_loras, max_lora_rank, tp_group)
            preallocate = self.device.type == "cuda" if preallocate_kv is None else preallocate_kv
            graphed = cuda_graphs and tp_group is None and graph_refusal(self.model) is None  # see _step_graphs
            self.pool = self._kv_pool(kv_heads, max_batch_size, graphed, preallocate, gpu_memory_utilization)
            self.cos, self.signed_sin = model_rope_tables(cfg.rope_dim, cfg.rope, cfg.local_rope, self.max_positions,
                                                          self.device, torch.float32 if cfg.rope_fp32 else self.dtype)
            self.graphs = self._step_graphs(cuda_graphs, tp_group, max_batch_size, branch_depth)
        self._seqs: dict[Hashable, list[int]] = {}  # seq_id -> [pool row, stored length]
        self._kept: set[Hashable] = set()  # renamed ones: finished rows the prefix cache keeps
        self._lora_rows: dict[int, tuple[int, int]] = {}  # pool row -> (slot, that slot's load count) when adapted
        self._lora_loads = [0] * max_loras  # per slot: loads and evictions so far (a kept row's KV names its adapter)

    def _load_model(self, model_dir, tp_group) -> int:
        """The weights on this device (this rank's shard under tensor parallel), its vocabulary matched to
        vocab_size, linears pretransposed on the CPU; sets self.model and self.group (query heads per KV
        head). Returns this rank's KV head count, which sizes the KV pool."""
        self.model = build_model(self.config, model_dir, self.device, self.dtype, tp_group)
        match_vocab(self.model, self.config.vocab_size, self.vocab_size)
        if self.device.type == "cpu":
            pretranspose_linears(self.model)
        attn = self.model.model.layers[0].self_attn  # per-rank head counts (after tensor parallel)
        self.group = attn.num_heads // attn.num_kv_heads
        return attn.num_kv_heads

    def _lora_slots(self, max_loras, max_lora_rank, tp_group) -> LoRASlots | None:
        """The LoRA slot table (model/lora.py), its linears wrapped after pretranspose; None: LoRA off."""
        for name, value, least in (("max_loras", max_loras, 0), ("max_lora_rank", max_lora_rank, 1)):
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        return enable_lora(self.model, self.config, max_loras, max_lora_rank, tp_group) if max_loras else None

    def _kv_pool(self, kv_heads: int, max_batch_size: int, graphed: bool, preallocate: bool,
                 utilization: float) -> KVPool:
        """Checked against the memory left after the weights (model/memory.py). Preallocated: memory for
        every row at max_positions now (the pool's capacity still grows within it); else 4 rows of 128
        positions, grown on demand. With graphs, rows for a full batch and the scratch row from the start
        either way: a pool that grows drops every captured graph."""
        cfg = self.config
        need = KVNeed(max_batch_size, int(graphed), self.max_model_len,
                      kv_bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, self.dtype),
                      slack=self.max_positions - self.max_model_len)
        check_kv_fits(need, self.device, utilization, strict=preallocate)
        rows = need.rows if preallocate or graphed else 4
        return KVPool(cfg.num_layers, kv_heads, cfg.head_dim, self.max_positions, self.device, self.dtype,
                      rows=rows, reserve=preallocate)

    def _step_graphs(self, cuda_graphs: bool, tp_group, max_batch_size: int, branch_depth: int) -> StepGraphs | None:
        """Short forwards replayed as CUDA graphs (model/cuda_graphs.py); None: every forward eager.
        branch_depth: the most steps a branch state takes (the draft's K + 1)."""
        if not cuda_graphs:
            return None
        if self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, got {self.device}")
        # TP: NCCL collectives inside a capture are not done yet; a refused model keeps no graph's scratch row
        if tp_group is not None or graph_refusal(self.model, log_it=True) is not None:
            return None
        return StepGraphs(self.model, self.pool, self.cos, self.signed_sin, self.group, max_batch_size, branch_depth)

    # -- sequences -------------------------------------------------------------------------------
    def add(self, seq_id: Hashable, lora_slot: int | None = None):
        """lora_slot: the loaded adapter (load_lora) every token of this sequence runs through; None: the base model."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if lora_slot is not None:
            self._check_loaded(lora_slot)
        with torch.inference_mode():
            self._seqs[seq_id] = [self.pool.take_row(), 0]
        if lora_slot is not None:
            self._lora_rows[self._seqs[seq_id][0]] = (lora_slot, self._lora_loads[lora_slot])

    def free(self, seq_id: Hashable):
        self.pool.give_row(self._seq(seq_id)[0])
        self._lora_rows.pop(self._seqs[seq_id][0], None)
        del self._seqs[seq_id]
        self._kept.discard(seq_id)
        self._fit_capacity()

    def length(self, seq_id: Hashable) -> int:
        return self._seq(seq_id)[1]

    def spare_rows(self) -> int:
        """Pool rows free now (a sequence added beyond them grows the pool)."""
        return len(self.pool.free_rows)

    def rename(self, seq_id: Hashable, new_id: Hashable) -> None:
        """The same row and KV under another id: a live row renamed is kept (the prefix cache keeps finished rows
        this way), a kept one renamed is live again (a new sequence takes the row over)."""
        if new_id in self._seqs:
            raise ValueError(f"sequence {new_id!r} already exists")
        self._seqs[new_id] = self._seq(seq_id)
        del self._seqs[seq_id]
        if seq_id in self._kept:
            self._kept.discard(seq_id)
        else:
            self._kept.add(new_id)
        self._fit_capacity()

    def _fit_capacity(self) -> None:
        """Once the live sequences (not the kept rows, which copy_prefix reads after a reserve) are all a
        quarter of the pool's capacity or less, narrow it to the next power of two at twice the longest:
        the static forwards then stop attending over a long sequence that has gone. Only from a capacity
        above NARROW_ABOVE: a narrowing (and each widening after it) drops every captured CUDA graph, and
        narrowing after every request, as first written, had each request of over 128 positions capture
        every graph again twice (an H200, session 64: a 5-token verify then averaged 10.6 ms a call
        against 2.75 ms for a decode step), where attending over a few hundred stale positions is cheap."""
        if self.pool.capacity <= NARROW_ABOVE:
            return
        longest = max((n for key, (_, n) in self._seqs.items() if key not in self._kept), default=0)
        target = max(MIN_KV_CAPACITY, 1 << (2 * longest - 1).bit_length())
        if self.pool.capacity >= 2 * target:
            self.pool.shrink(target)

    @torch.inference_mode()
    def copy_prefix(self, src_id: Hashable, dst_id: Hashable, length: int) -> None:
        """dst_id (empty) gets src_id's first `length` positions, KV copied row to row (no forward)."""
        src, dst = self._seq(src_id), self._seq(dst_id)
        if dst[1] != 0 or not 0 < length <= src[1]:
            raise ValueError(f"copy_prefix({src_id!r} -> {dst_id!r}, {length}): the source holds {src[1]} positions, "
                             f"the destination {dst[1]} (must be 0)")
        if self._lora_rows.get(src[0]) != self._lora_rows.get(dst[0]):  # KV computed through another adapter
            raise ValueError(f"copy_prefix({src_id!r} -> {dst_id!r}): the sequences run different LoRA adapters")
        self.pool.reserve(length)  # a kept row may be longer than a narrowed pool's views
        self.pool.k[:, dst[0], :, :length] = self.pool.k[:, src[0], :, :length]
        self.pool.v[:, dst[0], :, :length] = self.pool.v[:, src[0], :, :length]
        dst[1] = length

    def truncate(self, seq_id: Hashable, length: int):
        seq = self._seq(seq_id)
        if not 0 <= length <= seq[1]:
            raise ValueError(f"truncate({seq_id!r}, {length}): length must be in 0..{seq[1]}")
        seq[1] = length  # positions beyond are masked until overwritten

    def _limit_name(self) -> str:
        slack = self.max_positions - self.max_model_len
        return f"max_model_len {self.max_model_len}" + (f" + {slack} positions of slack" if slack else "")

    def _seq(self, seq_id) -> list[int]:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r} (call add first)") from None

    # -- forwards --------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, seq_ids: Sequence, token_lists: Sequence[Sequence[int]], num_logits: Sequence[int]) -> list[torch.Tensor]:
        """Append token_lists[i] to sequence i; logits [num_logits[i], V] (float32) each. One forward, or
        chunks of at most max_num_batched_tokens // batch tokens a sequence (a long prefill's attention
        scores and activations grow with its length times the keys: chunks bound them)."""
        seqs = self._check_extend(seq_ids, token_lists, num_logits)
        chunk, longest = max(1, self.max_num_batched_tokens // len(seqs)), max(len(t) for t in token_lists)
        if longest <= chunk:
            return self._extend(seqs, token_lists, num_logits)
        out = [[] for _ in seqs]
        for lo in range(0, longest, chunk):
            part = [i for i, t in enumerate(token_lists) if len(t) > lo]
            pieces = [token_lists[i][lo:lo + chunk] for i in part]
            # Logits wanted from this chunk: the requested tail's overlap with it (always its own tail).
            wanted = [max(0, lo + len(p) - max(lo, len(token_lists[i]) - num_logits[i])) for i, p in zip(part, pieces)]
            for i, logits in zip(part, self._extend([seqs[i] for i in part], pieces, wanted)):
                out[i].append(logits)
        return [torch.cat(x) for x in out]

    def _extend(self, seqs: list[list[int]], token_lists, num_logits) -> list[torch.Tensor]:
        """One forward over checked sequences; num_logits[i] may be 0 here (a chunk before the tail)."""
        rows, starts = [s[0] for s in seqs], [s[1] for s in seqs]
        lens = [len(t) for t in token_lists]
        self.pool.reserve(max(s + n for s, n in zip(starts, lens)))
        if self.graphs is not None and self.graphs.supports_extend(starts, lens):
            out = [x[n - k:n] for x, n, k in zip(self.graphs.extend(rows, starts, token_lists), lens, num_logits)]
        else:
            out = self._eager_extend(rows, starts, lens, token_lists, num_logits)
        for seq, n in zip(seqs, lens):
            seq[1] += n
        return out

    def _eager_extend(self, rows, starts, lens, token_lists, num_logits) -> list[torch.Tensor]:
        ctx = ExtendBatch(self.pool, rows, starts, lens, self.cos, self.signed_sin, self.group, self.model.attention)
        hidden = self._run_model(self._padded_ids(token_lists, ctx.t), ctx, rows)  # [B, T, hidden]
        logits = self.model.logits(self._logit_rows(hidden, lens, num_logits)).float()
        return list(logits.split(list(num_logits)))

    def _padded_ids(self, token_lists, t: int) -> torch.Tensor:
        if len(token_lists) == 1:
            return torch.tensor([list(token_lists[0])], device=self.device)
        return torch.tensor([list(x) + [0] * (t - len(x)) for x in token_lists], device=self.device)

    def _logit_rows(self, hidden: torch.Tensor, lens, num_logits) -> torch.Tensor:
        b, t, d = hidden.shape
        if b == 1:
            return hidden[0, t - num_logits[0]:]
        idx = [i * t + j for i, (n, k) in enumerate(zip(lens, num_logits)) for j in range(n - k, n)]
        return hidden.reshape(b * t, d)[torch.tensor(idx, dtype=torch.long, device=hidden.device)]

    def _check_extend(self, seq_ids, token_lists, num_logits) -> list[list[int]]:
        if not len(seq_ids) == len(token_lists) == len(num_logits) or not seq_ids:
            raise ValueError("extend needs equally long, non-empty seq_ids, token_lists and num_logits")
        seqs = [self._seq(s) for s in seq_ids]
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("extend: a sequence appears twice in one call")
        for sid, seq, toks, n in zip(seq_ids, seqs, token_lists, num_logits):
            if not 1 <= n <= len(toks):
                raise ValueError(f"extend({sid!r}): num_logits must be in 1..{len(toks)}, got {n}")
            if seq[1] + len(toks) > self.max_positions:
                raise ValueError(f"extend({sid!r}): {seq[1]} + {len(toks)} tokens exceed {self._limit_name()}")
            if min(toks) < 0 or max(toks) >= self.vocab_size:
                raise ValueError(f"extend({sid!r}): token ids must be in 0..{self.vocab_size - 1}")
        return seqs

    @torch.inference_mode()
    def branch_start(self, seq_ids: Sequence, prefix_lens: Sequence[int], tokens) -> tuple[BranchState, torch.Tensor]:
        """N branches over shared prefixes; returns (state, next-token logits [N, V] float32)."""
        if not len(seq_ids) == len(prefix_lens) == len(tokens) or not seq_ids:
            raise ValueError("branch_start needs equally long, non-empty seq_ids, prefix_lens and tokens")
        rows, stored = [], 0
        for sid, plen in zip(seq_ids, prefix_lens):
            row, length = self._seq(sid)
            if not 0 <= plen <= length or plen >= self.max_positions:
                raise ValueError(f"branch_start({sid!r}): prefix_len must be in 0..{length} (stored), got {plen}")
            rows.append(row)
            stored = max(stored, length)
        if self.graphs is not None and self.graphs.supports_branches(rows):
            state = self.graphs.branch_state(seq_ids, rows, list(prefix_lens))
        else:
            state = new_branch_state(seq_ids, rows, list(prefix_lens), self.group, self.pool, stored_len=stored)
        return state, self._branch_forward(state, tokens)

    @torch.inference_mode()
    def branch_step(self, state: BranchState, tokens) -> torch.Tensor:
        """One more token per branch (LongTensor [N]); logits [N, V] float32."""
        if len(tokens) != state.num_branches:
            raise ValueError(f"branch_step: {len(tokens)} tokens for {state.num_branches} branches")
        if state.graph_key is None and state.keys is None:
            raise ValueError("branch_step: these branches were ended (branch_end)")
        if state.max_prefix_len + state.depth >= self.max_positions:
            raise ValueError(f"branch_step: a branch would pass {self._limit_name()}")
        return self._branch_forward(state, tokens)

    @torch.inference_mode()
    def branch_end(self, state: BranchState) -> None:
        """No more steps on `state`: what only steps needed is freed; adopt_branch still reads it."""
        end_branches(state)

    @torch.inference_mode()
    def adopt_branch(self, state: BranchState, branch: int, depth: int) -> None:
        """Append the first `depth` tokens of branch `branch` to its sequence, their KV copied from the
        branch's private slots (no forward). The sequence must still end where the branch starts."""
        seq_id = state.seq_ids[branch]
        seq = self._seq(seq_id)
        u, j = divmod(int(state.out_index[branch]), state.prefix_len.shape[1])
        if seq[1] != int(state.prefix_len[u, j]) or not 0 < depth <= state.depth:
            raise ValueError(f"adopt_branch({seq_id!r}): the sequence holds {seq[1]} positions, the branch starts at "
                             f"{int(state.prefix_len[u, j])} and ran {state.depth} tokens; asked for {depth}")
        self.pool.reserve(seq[1] + depth)
        q = state.prefix_len.shape[1]
        slots = slice(j, depth * q, q)  # private slot d * Q + j holds the branch's token at depth d
        self.pool.k[:, seq[0], :, seq[1]:seq[1] + depth] = state.private_k[:, u, :, slots]
        self.pool.v[:, seq[0], :, seq[1]:seq[1] + depth] = state.private_v[:, u, :, slots]
        seq[1] += depth

    def _branch_forward(self, state: BranchState, tokens) -> torch.Tensor:
        if state.graph_key is not None:
            logits = self.graphs.branch_forward(state, tokens)
            state.depth += 1
            return logits
        tokens = torch.as_tensor(tokens, device=self.device).long()
        if state.dense:  # the tokens are already in the [U, Q] layout: no scatter in, no gather out
            ids = tokens.reshape(state.prefix_len.shape)
        else:
            ids = torch.zeros(state.prefix_len.shape, dtype=torch.long, device=self.device)
            ids.view(-1)[state.out_index] = tokens
        ctx = BranchBatch(state, self.cos, self.signed_sin, self.group, self.model.attention)
        hidden = self._run_model(ids, ctx, state.rows)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        state.depth += 1
        return self.model.logits(hidden if state.dense else hidden[state.out_index]).float()

    def _run_model(self, ids: torch.Tensor, ctx, rows: list[int]) -> torch.Tensor:
        """The model's forward over ids [len(rows), T]; with LoRA on, row b's tokens through its sequence's
        adapter (ctx.lora: the step's slot groups, model/lora.py). LoRA off: the model alone, no op added."""
        if self.lora is None:
            return self.model(ids, ctx)
        slots = [self._lora_rows.get(row, (-1,))[0] for row in rows]
        ctx.lora = lora_tokens(slots, ids.shape[1], self.lora.scales, self.device)
        with self.lora.selecting(ctx.lora):
            return self.model(ids, ctx)

    # -- LoRA adapters ---------------------------------------------------------------------------
    def load_lora(self, slot: int, adapter: str | LoRAAdapter, revision: str | None = None) -> None:
        """Put an adapter (a PEFT folder, a Hub id, or a loaded LoRAAdapter) in slot 0..max_loras - 1, replacing
        what it held; no live sequence may be using the slot."""
        self._check_free(slot)
        if not isinstance(adapter, LoRAAdapter):
            adapter = load_adapter(adapter, self.config, self.lora.max_lora_rank, revision)
        elif adapter.rank > self.lora.max_lora_rank:
            raise ValueError(f"LoRA adapter {adapter.source}: rank {adapter.rank} is greater than max_lora_rank "
                             f"{self.lora.max_lora_rank}")
        self._lora_loads[slot] += 1  # (before: a load that fails mid-way leaves the slot emptied, a new load)
        with torch.inference_mode():
            self.lora.load(slot, adapter)

    def evict_lora(self, slot: int) -> None:
        """Empty a slot; no live sequence may be using it."""
        self._check_free(slot)
        with torch.inference_mode():
            self.lora.evict(slot)
        self._lora_loads[slot] += 1

    def lora_slot(self, seq_id: Hashable) -> int | None:
        """The slot a sequence runs (None: the base model)."""
        return self._lora_rows.get(self._seq(seq_id)[0], (None,))[0]

    def _check_free(self, slot: int) -> None:
        if self.lora is None:
            raise ValueError("LoRA is off for this runner: construct it with max_loras >= 1")
        self.lora.check_slot(slot)
        users = [k for k, s in self._seqs.items() if k not in self._kept and self._lora_rows.get(s[0], (-1,))[0] == slot]
        if users:
            raise ValueError(f"lora slot {slot} is in use by sequence(s) {users[:4]!r}: free them first")

    def _check_loaded(self, slot: int) -> None:
        if self.lora is None:
            raise ValueError("add: lora_slot given, but LoRA is off for this runner (max_loras 0)")
        self.lora.check_slot(slot)
        if self.lora.adapters[slot] is None:
            raise ValueError(f"add: lora slot {slot} holds no adapter (call load_lora first)")
