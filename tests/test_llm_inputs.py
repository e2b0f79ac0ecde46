"""LLM.generate / chat inputs as vLLM users write them: TextPrompt / TokensPrompt dicts, max_tokens=None (to the
end of the context), and a clear error for an empty conversation in chat's list."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams
from test_serve_fixtures import make_tokenizer, write_llama

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def ar(tiny_checkpoint):
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_model_len=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """An AR engine over a tiny Llama that ships a (word-level) tokenizer: text prompts and chat."""
    path = write_llama(tmp_path_factory.mktemp("h10_worded"), make_tokenizer(), hidden=32, layers=1, seed=3)
    with LLM(model=path, mode="ar") as llm:
        yield llm


def test_token_prompt_dicts_run_as_prompt_token_ids(ar):
    """vLLM's TokensPrompt ({"prompt_token_ids": [...]}), alone or in a list: was "every prompt must be a
    non-empty string" (or "no tokenizer" on a model without one, as this one)."""
    want = [o.token_ids for o in ar.generate(prompt_token_ids=[[3, 4, 5], [6, 7]], sampling_params=GREEDY, use_tqdm=False)]
    got = ar.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": (6, 7)}], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == want and [o.prompt_token_ids for o in got] == [[3, 4, 5], [6, 7]]
    assert ar.generate({"prompt_token_ids": [6, 7]}, GREEDY, use_tqdm=False)[0].token_ids == want[1]


@pytest.mark.parametrize("prompt, match", [({"prompt_token_ids": [3], "multi_modal_data": {}}, "multi_modal_data"),
                                           ({}, "prompt 0 must be"), ({"prompt_token_ids": []}, "empty prompt"),
                                           ({"prompt_token_ids": [3.5]}, "integer token ids"),
                                           ({"prompt": 5}, "'prompt' must be a non-empty string"),
                                           (5, "prompt 0 is 5")])
def test_bad_prompt_dicts_are_clear_errors_and_lose_nothing(ar, prompt, match):
    with pytest.raises(ValueError, match=match):
        ar.generate([prompt], GREEDY, use_tqdm=False)
    assert len(ar.generate({"prompt_token_ids": [3]}, GREEDY, use_tqdm=False)[0].token_ids) == 4


def test_text_prompt_dicts_and_mixed_lists(worded):
    texts = ["the cat sat", "hello world"]
    want = worded.generate(texts, GREEDY, use_tqdm=False)
    got = worded.generate([{"prompt": texts[0]}, {"prompt_token_ids": want[1].prompt_token_ids, "prompt": texts[1]}],
                          GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.prompt for o in got] == texts and [o.text for o in got] == [o.text for o in want]


def test_max_tokens_none_generates_to_the_end_of_the_context(ar):
    """vLLM's max_tokens=None: the room the prompt leaves (was refused: "max_tokens must be an integer >= 1")."""
    prompts = [[3, 4, 5, 6, 7], [8] * 20]
    outs = ar.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=None,
                                                                                ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [27, 12] and {o.finish_reason for o in outs} == {"length"}
    explicit = ar.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=27, ignore_eos=True), use_tqdm=False)[0]
    assert outs[0].token_ids == explicit.token_ids


def test_max_tokens_none_with_no_room_is_a_clear_error(ar):
    with pytest.raises(ValueError, match="leaves 0 of the model's max length 32"):
        ar.generate(prompt_token_ids=[[3, 4], [5] * 32], sampling_params=SamplingParams(max_tokens=None), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens=10 needs 10"):
        ar.generate(prompt_token_ids=[[5] * 25], sampling_params=SamplingParams(max_tokens=None, min_tokens=10),
                    use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=-1)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5
    assert ar.load.num_waiting == ar.load.num_running == 0  # nothing of the refused batch was submitted


def test_max_tokens_none_under_speculation_matches_ar(tiny_llama_pair, ar):
    """None means the room left to the context's end, with AR's tokens (once SD stopped K+1 short)."""
    target, draft = tiny_llama_pair
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    with LLM(model=target, draft=draft, mode="sd", k=2, max_model_len=32) as sd:
        got = sd.generate(prompt_token_ids=[[3, 4, 5, 6, 7]], sampling_params=params, use_tqdm=False)[0].token_ids
    assert len(got) == 32 - 5
    assert got == ar.generate(prompt_token_ids=[[3, 4, 5, 6, 7]], sampling_params=params, use_tqdm=False)[0].token_ids[:27]


def test_chat_refuses_an_empty_conversation_in_a_list(worded):
    """chat([]) was refused but chat([[]]) rendered a prompt of no messages ("Assistant:") and generated."""
    for messages in ([[]], [[], HELLO], [HELLO, ()]):
        with pytest.raises(ValueError, match="non-empty list"):
            worded.chat(messages, GREEDY, use_tqdm=False)
    assert len(worded.chat([HELLO, HELLO], GREEDY, use_tqdm=False)) == 2
