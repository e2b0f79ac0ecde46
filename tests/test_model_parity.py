"""Logits of ModelRunner equal transformers' own on real tiny checkpoints, for every way the engine calls it."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from saguaro_dist.model import ModelRunner

KINDS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "tied", "sharded"]
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    return ModelRunner(path), AutoModelForCausalLM.from_pretrained(path).eval()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `tokens`, no cache: [len, V]."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_prefill_then_decode(pair):
    runner, hf = pair
    seq = tokens(1, 16)
    ref = hf_logits(hf, seq)
    runner.add("p")
    close(runner.extend(["p"], [seq[:10]], [10])[0], ref[:10])
    for i in range(10, 16):
        close(runner.extend(["p"], [[seq[i]]], [1])[0], ref[i:i + 1])
    assert runner.length("p") == 16
    runner.free("p")


def test_score_k_plus_1_then_truncate_and_continue(pair):
    runner, hf = pair
    prompt, spec, other = tokens(2, 9), tokens(3, 5), tokens(4, 4)
    runner.add("s")
    runner.extend(["s"], [prompt], [1])
    close(runner.extend(["s"], [spec], [5])[0], hf_logits(hf, prompt + spec)[9:])
    runner.truncate("s", 11)  # two of the five accepted; the rest must leave no trace
    assert runner.length("s") == 11
    close(runner.extend(["s"], [other], [4])[0], hf_logits(hf, prompt + spec[:2] + other)[11:])
    runner.free("s")


def test_batched_extend_of_different_lengths(pair):
    runner, hf = pair
    for sid in ("a", "gap", "b", "c"):
        runner.add(sid)
    runner.free("gap")  # leaves the rows of a, b, c non-contiguous
    pasts = {"a": tokens(5, 7), "b": tokens(6, 3), "c": []}
    runner.extend(["a", "b"], [pasts["a"], pasts["b"]], [1, 1])
    new = {"c": tokens(7, 6), "a": tokens(8, 1), "b": tokens(9, 4)}
    ids = ["c", "a", "b"]
    out = runner.extend(ids, [new[s] for s in ids], [6, 1, 2])
    for sid, got, n in zip(ids, out, [6, 1, 2]):
        full = pasts[sid] + new[sid]
        close(got, hf_logits(hf, full)[len(full) - n:])
    # same-length batch on contiguous rows (the fast view path)
    out = runner.extend(["a", "b"], [[1, 2], [3, 4]], [2, 2])
    close(out[0], hf_logits(hf, pasts["a"] + new["a"] + [1, 2])[-2:])
    close(out[1], hf_logits(hf, pasts["b"] + new["b"] + [3, 4])[-2:])
    for sid in ("a", "b", "c"):
        runner.free(sid)


def test_branch_decode_matches_each_branch_alone(pair):
    runner, hf = pair
    seqs = {"x": tokens(10, 12), "y": tokens(11, 6)}
    for sid, toks in seqs.items():
        runner.add(sid)
        runner.extend([sid], [toks], [1])
    # several sequences, different prefix_lens (also 0 and the full length), in mixed order
    owners = ["x", "y", "x", "x", "y", "x"]
    plens = [12, 6, 9, 12, 2, 0]
    depth = 11  # passes the private buffer's first capacity (8), so it must grow
    paths = [tokens(20 + i, depth) for i in range(len(owners))]
    state, logits = runner.branch_start(owners, plens, [p[0] for p in paths])
    got = [logits]
    for d in range(1, depth):
        got.append(runner.branch_step(state, torch.tensor([p[d] for p in paths])))
    for i, (sid, plen, path) in enumerate(zip(owners, plens, paths)):
        ref = hf_logits(hf, seqs[sid][:plen] + path)[plen:]
        close(torch.stack([g[i] for g in got]), ref)
    assert runner.length("x") == 12 and runner.length("y") == 6  # branches commit nothing
    for sid in seqs:
        runner.free(sid)


@pytest.mark.parametrize("gap", [False, True], ids=["rows-in-a-run", "rows-apart"])
def test_branches_leave_the_stored_kv_as_it_was(pair, gap):
    """Branches shorter than what their sequences store (a tree after the glue ran x_1..x_K): the private
    slots live in the pool rows' unused tails when the rows are consecutive, a copy when they are not;
    either way every stored position is untouched and the branches see only their own prefixes."""
    runner, hf = pair
    names = ["u", "gap", "v"] if gap else ["u", "v"]
    for sid in names:
        runner.add(sid)
    if gap:
        runner.free("gap")
    seqs = {"u": tokens(40, 10), "v": tokens(41, 7)}
    runner.extend(list(seqs), list(seqs.values()), [1, 1])
    rows = [runner._seq(sid)[0] for sid in seqs]
    stored = [(runner.pool.k[:, r, :, :10].clone(), runner.pool.v[:, r, :, :10].clone()) for r in rows]
    owners, plens = ["u", "u", "v", "u"], [4, 6, 3, 9]
    paths = [tokens(50 + i, 5) for i in range(len(owners))]
    state, logits = runner.branch_start(owners, plens, [p[0] for p in paths])
    in_pool = state.keys.untyped_storage().data_ptr() == runner.pool.k.untyped_storage().data_ptr()
    assert in_pool is not gap
    got = [logits] + [runner.branch_step(state, torch.tensor([p[d] for p in paths])) for d in range(1, 5)]
    runner.branch_end(state)
    for i, (sid, plen, path) in enumerate(zip(owners, plens, paths)):
        close(torch.stack([g[i] for g in got]), hf_logits(hf, seqs[sid][:plen] + path)[plen:])
    for r, (k, v) in zip(rows, stored):
        assert torch.equal(runner.pool.k[:, r, :, :10], k) and torch.equal(runner.pool.v[:, r, :, :10], v)
    close(runner.extend(["u"], [[7]], [1])[0], hf_logits(hf, seqs["u"] + [7])[-1:])
    for sid in seqs:
        runner.free(sid)


def test_adopting_a_branch_continues_like_extending_its_tokens(pair):
    runner, hf = pair
    seq, paths = tokens(30, 10), [tokens(31, 4), tokens(32, 4)]
    runner.add("z")
    runner.extend(["z"], [seq], [1])
    state, _ = runner.branch_start(["z", "z"], [10, 8], [paths[0][0], paths[1][0]])
    for d in range(1, 4):
        runner.branch_step(state, torch.tensor([paths[0][d], paths[1][d]]))
    runner.branch_end(state)  # frees the prefixes' copy; what adoption reads stays
    assert state.keys is None and state.private_k.shape[3] == 4 * 2
    with pytest.raises(ValueError, match="were ended"):
        runner.branch_step(state, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="branch starts at 8"):
        runner.adopt_branch(state, 1, 3)  # the sequence holds 10 positions, not the branch's prefix 8
    runner.truncate("z", 8)
    runner.adopt_branch(state, 1, 3)
    assert runner.length("z") == 11
    close(runner.extend(["z"], [[7]], [1])[0], hf_logits(hf, seq[:8] + paths[1][:3] + [7])[-1:])
    runner.free("z")


def test_chunked_prefill_gives_the_one_forward_logits(pair):
    """A forward of at most 5 tokens: two prompts of 12 and 7 (plus a decode row) run in chunks of 2
    tokens a sequence; every requested logit row, across chunk boundaries, equals transformers'."""
    _, hf = pair
    chunked = ModelRunner(hf.name_or_path, max_num_batched_tokens=5)
    long, short = tokens(5, 12), tokens(6, 7)
    chunked.add("l")
    chunked.add("s")
    got = chunked.extend(["l", "s"], [long, short], [12, 3])
    close(got[0], hf_logits(hf, long))
    close(got[1], hf_logits(hf, short)[4:])
    more = chunked.extend(["l", "s"], [[9, 10, 11], [12]], [3, 1])  # 3 + 1 tokens: chunks of 2 again
    close(more[0], hf_logits(hf, long + [9, 10, 11])[12:])
    close(more[1], hf_logits(hf, short + [12])[7:])
    assert chunked.length("l") == 15 and chunked.length("s") == 8
