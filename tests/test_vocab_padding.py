"""A draft whose embedding table differs from the target's only by padding rows (Qwen2.5's 151936 vs
152064 over one tokenizer) speaks the target's vocabulary: its logits cut or padded with -inf, ids it
has no row for read a placeholder row. Greedy output stays the target's on every executor and on Ray,
also when the target picks a padding id; pairs that do not share a tokenizer are refused before any
weights load. (The sampled law through such a pair: tests/test_engine_sampling.py.)"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_helpers import DEVICE, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.bench.prompts import resolve_pair
from saguaro_dist.model import ModelRunner, check_pair_vocab
from test_engine_sampling import TINY_VOCAB, save_tiny_tokenizer

USED = len(TINY_VOCAB)          # ids the tokenizer makes
TARGET_ROWS, SHORT_ROWS, LONG_ROWS = USED + 2, USED, USED + 4
PROMPTS = [[1, 2, 3], [4, 0], [2, 2, 5, 1]]


def save_resized(path, source: LlamaForCausalLM, rows: int, seed: int) -> None:
    """A draft close to `source` (its weights plus noise) with `rows` embedding rows, the tokenizer beside it."""
    gen = torch.Generator().manual_seed(seed)
    clone = LlamaForCausalLM(copy.deepcopy(source.config)).eval()  # resizing rewrites its config
    with torch.no_grad():
        for p, q in zip(clone.parameters(), source.parameters()):
            p.copy_(q + 0.3 * q.std() * torch.randn(q.shape, generator=gen))
    clone.resize_token_embeddings(rows)
    clone.save_pretrained(path)
    save_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """target: USED + 2 rows (two padding rows, random: the target gives them real probability);
    drafts: one with exactly the tokenizer's rows, one with more rows than the target."""
    root = tmp_path_factory.mktemp("padded_vocab")
    target = save_model(root / "target", llama_config(TARGET_ROWS, 32, 2), seed=11, sharpen=2.0)
    save_tiny_tokenizer(root / "target")
    save_resized(root / "short", target, SHORT_ROWS, seed=12)
    save_resized(root / "long", target, LONG_ROWS, seed=13)
    return {"target": str(root / "target"), "short": str(root / "short"), "long": str(root / "long")}


def generate(pairs, draft: str | None, params: SamplingParams, **kwargs) -> list[list[int]]:
    """Token ids; a draft's proposals must all have come from it (its failure would be the fast backup's)."""
    mode = kwargs.pop("mode", "ssd" if draft else "ar")
    with LLM(model=pairs["target"], draft=pairs.get(draft), mode=mode, device=DEVICE, k=2, fan_out=6,
             fallback="neural", **kwargs) as llm:
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        metrics = llm.metrics
    assert not draft or (metrics.accepted_tokens > 0 and not metrics.fallbacks["fast"]), metrics
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# A bias that makes the target pick its padding ids now and then: the draft must read them.
PADDING_BIASED = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                logit_bias={USED: 0.2, USED + 1: 0.2})


@pytest.fixture(scope="module")
def references(pairs):
    return {name: generate(pairs, None, p) for name, p in (("plain", GREEDY), ("padding", PADDING_BIASED))}


def test_the_padding_bias_makes_the_target_pick_padding_ids(references):
    picked = [t for seq in references["padding"] for t in seq]
    assert any(t >= USED for t in picked) and any(t < USED for t in picked), references["padding"]


@pytest.mark.parametrize("draft", ["short", "long"])
@pytest.mark.parametrize("mode,executor", [("sd", "thread"), ("ssd", "thread"), ("ssd", "process")])
@pytest.mark.parametrize("reference", ["plain", "padding"])
def test_greedy_output_is_the_targets(pairs, references, draft, mode, executor, reference):
    params = GREEDY if reference == "plain" else PADDING_BIASED
    assert generate(pairs, draft, params, mode=mode, draft_executor=executor) == references[reference]


def test_on_ray_the_draft_actors_speak_the_targets_vocabulary(pairs, references, ray_cluster):
    with LLM(model=pairs["target"], draft=pairs["short"], mode="ssd", cluster="local", k=2, fan_out=6,
             num_draft_workers=1, startup_timeout_s=120) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PADDING_BIASED)
        import ray
        sizes = ray.get([d.vocab_size.remote() for d in llm._thread.deployment.drafts])
    assert [o.token_ids for o in outs] == references["padding"]
    assert sizes == [TARGET_ROWS]


def test_a_matched_runner_scores_the_targets_ids(pairs):
    """Its own ids score as before and the target's extra ids get -inf; an id it has no row for is
    taken (it reads a zero row); a longer table is cut to the target's ids."""
    own = ModelRunner(pairs["short"])
    matched = ModelRunner(pairs["short"], vocab_size=TARGET_ROWS)
    assert (own.vocab_size, matched.vocab_size) == (SHORT_ROWS, TARGET_ROWS)
    for runner in (own, matched):
        runner.add("a")
    [plain] = own.extend(["a"], [[1, 2, 3]], [1])
    [padded] = matched.extend(["a"], [[1, 2, 3]], [1])
    torch.testing.assert_close(padded[..., :SHORT_ROWS], plain)
    assert torch.isneginf(padded[..., SHORT_ROWS:]).all()
    [after_padding_id] = matched.extend(["a"], [[USED + 1]], [1])
    assert torch.isfinite(after_padding_id[..., :SHORT_ROWS]).all()
    longer, cut = ModelRunner(pairs["long"]), ModelRunner(pairs["long"], vocab_size=TARGET_ROWS)
    for runner in (longer, cut):
        runner.add("a")
    [full] = longer.extend(["a"], [[1, 2, 3]], [1])
    [short] = cut.extend(["a"], [[1, 2, 3]], [1])
    assert short.shape == (1, TARGET_ROWS)
    torch.testing.assert_close(short, full[..., :TARGET_ROWS])


def test_pairs_that_share_no_tokenizer_are_refused_before_weights_load(pairs, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(pairs["target"])
    check_pair_vocab(TARGET_ROWS, SHORT_ROWS, tok, tok)
    other = LlamaForCausalLM(llama_config(TARGET_ROWS + 3, 16, 1))
    other.save_pretrained(tmp_path / "bare")  # no tokenizer: nothing shows the extra rows are padding
    with pytest.raises(ValueError, match="without both tokenizers"):
        LLM(model=pairs["target"], draft=str(tmp_path / "bare"), mode="sd")
    with pytest.raises(ValueError, match="makes 6 ids"):
        check_pair_vocab(TARGET_ROWS, USED - 1, tok, tok)
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_pair_vocab(TARGET_ROWS, TARGET_ROWS, tok, AutoTokenizer.from_pretrained(resolve_pair(None, None)[0]))
