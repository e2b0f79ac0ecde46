"""A generate() call tokenizes each distinct bad word once, however many prompts name it (vLLM's offline batches
often share one SamplingParams): it used to tokenize it twice a prompt (the word, and " " + word), 3.3 s of CPU per
10^4 prompts on the test pair's tokenizer."""
from __future__ import annotations

from transformers import AutoTokenizer

from saguaro_dist import LLM, SamplingParams
from test_engine_sampling import PROMPT, sampling_pair


def test_a_batch_tokenizes_each_bad_word_once(tmp_path):
    target, _, _ = sampling_pair(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(target)
    words = [tokenizer.decode([2]), tokenizer.decode([3, 4])]
    with LLM(model=target, mode="ar") as llm:
        plain, encoded = llm._encode_bad_word, []
        llm._encode_bad_word = lambda word: (encoded.append(word), plain(word))[1]
        params = SamplingParams(temperature=0, max_tokens=2, bad_words=words, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=[PROMPT] * 100, sampling_params=params, use_tqdm=False)
        alone = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    spellings = {w for word in words for w in (word.lstrip(), " " + word.lstrip())}
    assert sorted(encoded) == sorted(list(spellings) * 2), "one tokenization a spelling a call (two calls here)"
    assert all(o.outputs[0].token_ids == alone[0].outputs[0].token_ids for o in outs)
    assert all(t != 2 for t in alone[0].outputs[0].token_ids)
