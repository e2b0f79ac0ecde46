"""How large a DraftService message may be. gRPC refuses one over its limit (RESOURCE_EXHAUSTED), so the server's
limit is sized from its configuration: a fixed 64 MiB failed every round of a sampled batch with a large
vocabulary (Qwen2's V = 151936, K = 3, 45 sequences: an 82 MB just-in-time answer). q keeps its float32 (exactness
relies on it): the limit grows instead, up to gRPC's own ceiling, and a reply that still could not go out is
refused before the worker changes anything.
"""
from __future__ import annotations

import logging

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.proto import saguaro_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "GRPC_MAX_MESSAGE_BYTES", "ReplyTooLarge", "check_jit_reply", "encode_trees",
           "max_message_bytes", "message_limit_for"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the floor (a small vocabulary's messages fit far below it)
GRPC_MAX_MESSAGE_BYTES = 2 ** 31 - 1  # gRPC's ceiling: a message's length is an int32
Q_ITEMSIZE = 4  # q crosses as float32, bit for bit
TOKEN_ITEMSIZE = 4  # token ids cross as int32


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


def check_jit_reply(worker, reqs: list, limit: int) -> None:
    """Refuse a just-in-time draft whose answer could exceed `limit`, before the worker drafts: refused after, the
    worker had already committed the outcome, and the target's retry found it a round ahead."""
    bound = getattr(worker, "jit_reply_bytes", None)
    if bound is not None and (size := bound(reqs)) > limit:
        raise ReplyTooLarge(f"a just-in-time draft of {len(reqs)} sequence(s) could answer {size} bytes, over the "
                            f"{limit} byte message limit: refused before drafting (ask for fewer at once)")


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
