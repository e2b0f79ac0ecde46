"""How large a DraftService message may be. gRPC refuses one over its limit (RESOURCE_EXHAUSTED), so the server's
limit is sized from its configuration: a fixed 64 MiB failed every round of a sampled batch with a large
vocabulary (Qwen2's V = 151936, K = 3, 45 sequences: an 82 MB just-in-time answer). q keeps its float32 (exactness
relies on it): the limit grows instead, up to gRPC's own ceiling. A just-in-time answer over even that (batch 512,
K 8, a 256k vocabulary: 4 GiB) crosses the Speculate stream in parts, each under the limit, that the target joins
(JitDraftResult.parts_after); refused every round, such a config could never draft. Only a unary JitDraft's answer,
one message, is refused (before the worker changes anything), and a server whose limit cannot hold even one row
is refused at start-up.
"""
from __future__ import annotations

import logging

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.proto import saguaro_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "GRPC_MAX_MESSAGE_BYTES", "ReplyTooLarge", "check_jit_reply",
           "check_limit_holds_a_row", "encode_jit_result", "encode_trees", "max_message_bytes", "message_limit_for"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the floor (a small vocabulary's messages fit far below it)
GRPC_MAX_MESSAGE_BYTES = 2 ** 31 - 1  # gRPC's ceiling: a message's length is an int32
Q_ITEMSIZE = 4  # q crosses as float32, bit for bit
TOKEN_ITEMSIZE = 4  # token ids cross as int32
# A part's SpeculateReply / JitDraftResult / ProposalBatch wrappers around its proposals: tags, length prefixes, the
# call id, parts_after and the stamped graph_captures (each a varint of at most 10 bytes).
PART_FRAMING = 64
PROPOSAL_FRAMING = 6  # a proposal's tag and length prefix inside ProposalBatch


class ReplyTooLarge(Exception):
    """A reply that could not be sent within the message limit, refused before the worker changed anything."""


def max_message_bytes(max_batch_size: int, k: int, branches: int, vocab_size: int, max_model_len: int = 0) -> int:
    """Room for a dense q in every branch (K + 1 positions) of every sequence's tree, which bounds a just-in-time
    answer (B x K x V) and any tree batch, and for a batch of prompts at max_model_len; twice over for framing.
    At least the default, at most gRPC's ceiling."""
    q = max_batch_size * max(branches, 1) * (k + 1) * vocab_size * Q_ITEMSIZE
    prompts = max_batch_size * max_model_len * TOKEN_ITEMSIZE
    return min(GRPC_MAX_MESSAGE_BYTES, max(DEFAULT_MAX_MESSAGE_BYTES, 2 * max(q, prompts)))


def message_limit_for(worker) -> int:
    """The limit to serve `worker` with: from its config, vocabulary and context (the default without them)."""
    config, vocab_size = getattr(worker, "config", None), getattr(worker, "vocab_size", None)
    if config is None or vocab_size is None:
        return DEFAULT_MAX_MESSAGE_BYTES
    max_model_len = getattr(getattr(worker, "runner", None), "max_model_len", 0) or 0
    return max_message_bytes(config.max_batch_size, config.k, config.fan_out_budget, vocab_size, max_model_len)


def jit_row_bytes(k: int, vocab_size: int) -> int:
    """A bound of one sampled row's answer: a dense K x V float32 q, K tokens, framing (DraftWorker.jit_reply_bytes
    of one sequence)."""
    return k * vocab_size * Q_ITEMSIZE + k * TOKEN_ITEMSIZE + 64 + 1024


def check_limit_holds_a_row(worker, limit: int) -> None:
    """At start-up: a limit that cannot hold one sampled row's answer could never answer a sampled draft."""
    config, vocab_size = getattr(worker, "config", None), getattr(worker, "vocab_size", None)
    if config is None or vocab_size is None:
        return
    if (row := jit_row_bytes(config.k, vocab_size)) > limit - PART_FRAMING:
        raise ValueError(f"max_message_bytes {limit} cannot hold one sampled just-in-time row (K={config.k} x "
                         f"vocabulary {vocab_size} float32: {row} bytes): raise it (gRPC allows up to "
                         f"{GRPC_MAX_MESSAGE_BYTES}) or lower k")


def check_jit_reply(worker, reqs: list, limit: int, in_parts: bool) -> None:
    """Refuse a just-in-time draft whose answer could not be sent within `limit`, before the worker drafts: refused
    after, the worker had already committed the outcome, and the target's retry found it a round ahead. in_parts
    (the stream): only a row that alone could exceed a part is; else (a unary call) the whole answer."""
    bound = getattr(worker, "jit_reply_bytes", None)
    if bound is None or (size := bound(reqs)) <= limit:
        return
    if not in_parts:
        raise ReplyTooLarge(f"a just-in-time draft of {len(reqs)} sequence(s) could answer {size} bytes, over the "
                            f"{limit} byte message limit: refused before drafting (ask for fewer at once, or on the "
                            "Speculate stream, which sends it in parts)")
    if (row := max(bound([r]) for r in reqs)) > limit - PART_FRAMING:
        raise ReplyTooLarge(f"a just-in-time row could answer {row} bytes, over the {limit} byte message limit: "
                            "refused before drafting")


def encode_jit_result(call_id: int, proposals: list, limit: int) -> list[pb.SpeculateReply]:
    """The answer to just-in-time call `call_id` as results that each fit `limit`: one when it fits, else the
    proposals in order over several (parts_after counts down to 0). ReplyTooLarge if one proposal alone cannot."""
    msgs = [codec.proposal_to_proto(p) for p in proposals]
    parts, current, current_bytes = [], [], PART_FRAMING
    for msg in msgs:
        size = msg.ByteSize() + PROPOSAL_FRAMING
        if size + PART_FRAMING > limit:
            raise ReplyTooLarge(f"a just-in-time proposal of {size} bytes exceeds the {limit} byte message limit")
        if current and current_bytes + size > limit:
            parts, current, current_bytes = parts + [current], [], PART_FRAMING
        current.append(msg)
        current_bytes += size
    parts.append(current)  # the last (for no proposals: the only, empty) part
    if len(parts) > 1:
        log.debug("just-in-time answer %d: %d proposals in %d parts under %d bytes", call_id, len(msgs), len(parts),
                  limit)
    return [pb.SpeculateReply(jit_draft=pb.JitDraftResult(call_id=call_id, parts_after=len(parts) - 1 - i,
                                                          proposals=pb.ProposalBatch(proposals=part)))
            for i, part in enumerate(parts)]


def encode_trees(trees, limit: int) -> list[pb.SpeculateReply]:
    """Tree batches that each fit `limit`; a single tree over it is dropped (a miss)."""
    replies, current, current_bytes = [], pb.SpeculateReply(), 0
    for tree in trees:
        msg = codec.tree_to_proto(tree)
        size = msg.ByteSize() + 16  # field tags and length prefixes
        if size > limit:
            log.error("tree of sequence %s round %s is %d bytes, over the %d byte limit: dropped",
                      tree.seq_id, tree.round, size, limit)
            continue
        # A running sum: the batch's own ByteSize() would serialise it again for every tree added.
        if current_bytes and current_bytes + size > limit:
            replies, current, current_bytes = replies + [current], pb.SpeculateReply(), 0
        current.trees.trees.append(msg)
        current_bytes += size
    return replies + [current] if current_bytes else replies
