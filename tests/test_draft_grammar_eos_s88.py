"""The draft's grammars end where the target's do: at any of the target's eos ids (generation_config.json's
list with the tokenizer's EOS: Llama 3's <|eot_id|> / <|end_of_text|>, Qwen's <|im_end|> / <|endoftext|>), not at
its tokenizer's EOS alone. Told only that one, the draft proposed it where the target chose another eos id: a
rejected token each finished request (acceptance, never exactness). Every draft path builds its worker with
build_draft_worker from the DraftFit (thread, the child process, Ray's draft actors)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer, GenerationConfig

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.build import build_draft_worker, fit_draft, target_tokenizer
from saguaro_dist.engine.structured import GrammarCompiler, grammar_of
from saguaro_dist.sampling_params import StructuredOutputsParams as SO
from test_serve_fixtures import write_llama

CHOICES = ["the cat sat", "a dog ran"]
EXTRA = 2  # <|pad|>, listed as an eos id beside <|eos|> (1): a special token the grammar allows only at its end


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft): one tiny Llama's weights twice (the draft proposes what the target chooses), the demo's
    byte-level tokenizer (llguidance reads it); only the target's generation_config.json lists [EOS, EXTRA]."""
    tokenizer = AutoTokenizer.from_pretrained(demo_pair()[1])
    target = write_llama(tmp_path_factory.mktemp("geos_target"), tokenizer, hidden=32, layers=1, seed=3)
    draft = write_llama(tmp_path_factory.mktemp("geos_draft"), tokenizer, hidden=32, layers=1, seed=3)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id, EXTRA]).save_pretrained(target)
    return target, draft


def ended(compiler_or_constraints, tokenizer, grammar: str):
    """The ids a grammar allows once its text is complete."""
    state = (compiler_or_constraints.state_of(grammar) if isinstance(compiler_or_constraints, GrammarCompiler)
             else compiler_or_constraints.grammar_state(grammar, []))
    assert state.advance(tokenizer.encode(CHOICES[0], add_special_tokens=False))
    return set(state.mask().nonzero().flatten().tolist())


def test_the_drafts_grammar_ends_at_every_eos_id_of_the_target(pair):
    target, draft = pair
    with LLM(model=target, mode="ar") as ar:  # the target's compiler, as LLM builds it
        eos_ids, tokenizer, vocab = ar.eos_token_ids, ar.tokenizer, ar.vocab_size
    assert set(eos_ids) == {tokenizer.eos_token_id, EXTRA}
    config = Config(model=target, draft=draft, mode="sd", k=4)
    worker = build_draft_worker(config, fit_draft(config, target_tokenizer(config)))
    grammar = grammar_of(SO(choice=CHOICES))
    want = ended(GrammarCompiler(tokenizer, vocab, eos_ids), tokenizer, grammar)
    assert want == set(eos_ids)
    assert ended(worker.constraints, tokenizer, grammar) == want


@pytest.mark.slow
def test_the_draft_proposes_the_eos_the_target_chooses(pair):
    """Greedy, the end biased to EXTRA: SD and SSD (its draft in a child process) give AR's tokens, ending at
    EXTRA, and the draft (the target's weights) has every drafted token accepted: with K = 2 the second round
    drafts the end (the old draft proposed EOS there: 3 of 4 accepted)."""
    target, draft = pair
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias={EXTRA: 50.0},
                            structured_outputs=SO(choice=CHOICES))
    prompts = ["the cat", "a dog", "once upon"]
    outs = {}
    for mode, kw in (("ar", {}), ("sd", {"draft": draft, "k": 2}),
                     ("ssd", {"draft": draft, "k": 2, "draft_executor": "process"})):
        with LLM(model=target, mode=mode, **kw) as llm:
            outs[mode] = llm.generate(prompts, params, use_tqdm=False)
    for mode in ("sd", "ssd"):
        for o, a in zip(outs[mode], outs["ar"]):
            assert o.token_ids == a.token_ids, mode
            assert o.token_ids[-1] == EXTRA and o.finish_reason == "stop"
            assert o.metrics.drafted_tokens > 0, mode
            assert o.metrics.accepted_tokens == o.metrics.drafted_tokens, (mode, o.metrics)
