"""LLM / SamplingParams as vLLM users call them: every vLLM argument is honoured as vLLM does, or refused by
name, never dropped without a word (chat's positional order, detokenize, get_tokenizer, use_tqdm callables,
lora_request and the other inputs this engine has no use for)."""
from __future__ import annotations

import asyncio

import pytest
from tqdm import tqdm

from saguaro_dist import LLM, SamplingParams
from test_serve_fixtures import make_tokenizer, write_llama

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
HELLO = [{"role": "user", "content": "hello world"}]
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}the{% endif %}"


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """An AR engine over a tiny Llama that ships a (word-level) tokenizer: text prompts and chat."""
    path = write_llama(tmp_path_factory.mktemp("h15_worded"), make_tokenizer(), hidden=32, layers=1, seed=3)
    with LLM(model=path, mode="ar") as llm:
        yield llm


def test_detokenize_false_returns_token_ids_without_text(worded):
    """vLLM's detokenize=False: the same tokens, text "" (was a TypeError: no such field)."""
    texted = worded.generate(["the cat sat"], GREEDY, use_tqdm=False)[0]
    bare = worded.generate(["the cat sat"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                           detokenize=False), use_tqdm=False)[0]
    assert texted.text and bare.token_ids == texted.token_ids
    assert bare.text == "" and bare.outputs[0].text == ""


def test_detokenize_false_streams_no_text(worded):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)

    async def deltas():
        return [d async for d in worded.stream("the cat sat", params)]
    got = asyncio.run(deltas())
    assert all(d.text == "" for d in got) and sum(len(d.token_ids) for d in got) == 4


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["cat"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be true or false"):
        SamplingParams(detokenize="false")


def test_get_tokenizer_and_get_default_sampling_params(worded, tiny_checkpoint):
    """vLLM's LLM.get_tokenizer() / get_default_sampling_params() (were AttributeErrors)."""
    assert worded.get_tokenizer() is worded.tokenizer
    assert worded.get_tokenizer().decode(worded.get_tokenizer().encode("hello world", add_special_tokens=False)) \
        == "hello world"
    assert worded.get_default_sampling_params() == worded.default_sampling_params()
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_model_len=32) as bare:
        with pytest.raises(ValueError, match="no tokenizer"):
            bare.get_tokenizer()


def test_chat_takes_vllm_positional_order(worded):
    """vLLM's chat(messages, sampling_params, use_tqdm, lora_request, chat_template, ...): the template given
    fifth renders the prompt (it landed in `priority` before, and use_tqdm third became `tools`)."""
    want = worded.tokenizer.encode("hello world the", add_special_tokens=False)
    out = worded.chat(HELLO, GREEDY, False, None, TEMPLATE)[0]
    assert out.prompt_token_ids == want
    assert out.token_ids == worded.chat(HELLO, GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0].token_ids
    closed = worded.chat(HELLO, GREEDY, False, None, TEMPLATE, "string", False)[0]  # add_generation_prompt seventh
    assert closed.prompt_token_ids == worded.tokenizer.encode("hello world ", add_special_tokens=False)


@pytest.mark.parametrize("call, name", [
    (lambda llm: llm.generate(["hello world"], GREEDY, use_tqdm=False, lora_request=object()), "lora_request"),
    (lambda llm: llm.generate(["hello world"], GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True}),
     "tokenization_kwargs"),
    (lambda llm: llm.chat(HELLO, GREEDY, False, object()), "lora_request"),
    (lambda llm: llm.chat(HELLO, GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4}), "mm_processor_kwargs"),
    (lambda llm: llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_content_format="parts"),
     "chat_template_content_format"),
])
def test_unsupported_vllm_arguments_are_refused_by_name(worded, call, name):
    with pytest.raises(ValueError, match=name):
        call(worded)


def test_chat_template_content_format_reaches_the_template(worded):
    """vLLM's chat_template_content_format: "auto" finds a template looping over content (text parts), "string"
    forces a string (walked a character at a time by such a template), "openai" parts."""
    loops = "{% for m in messages %}{% for p in m.content %}{{ p.text if p is mapping else p }} {% endfor %}{% endfor %}"
    prompts = {f: worded.chat(HELLO, GREEDY, False, None, loops, f, False)[0].prompt_token_ids
               for f in ("auto", "string", "openai")}
    whole = "".join(f"{m['content']} " for m in HELLO)
    assert prompts["auto"] == prompts["openai"] == worded.tokenizer.encode(whole, add_special_tokens=False)
    assert prompts["string"] != prompts["auto"]


def test_empty_vllm_arguments_run(worded):
    """vLLM code passes lora_request=None (and the like) explicitly: that runs (was a TypeError)."""
    want = worded.generate(["hello world"], GREEDY, use_tqdm=False)[0].token_ids
    assert worded.generate(["hello world"], GREEDY, use_tqdm=False, lora_request=None,
                           tokenization_kwargs=None)[0].token_ids == want
    assert worded.chat(HELLO, GREEDY, False, None, None, "auto", tools=None, tokenization_kwargs=None,
                       mm_processor_kwargs=None)[0].token_ids == worded.chat(HELLO, GREEDY, use_tqdm=False)[0].token_ids


def test_use_tqdm_callable_makes_the_bar(worded):
    """vLLM's use_tqdm callable (e.g. partial(tqdm, leave=False)) builds the bar (was taken as True)."""
    made = []

    def bar(**kwargs):
        made.append(kwargs["total"])
        return tqdm(disable=True, **kwargs)
    worded.generate(["hello world", "the cat sat"], GREEDY, use_tqdm=bar)
    worded.chat(HELLO, GREEDY, bar)
    assert made == [2, 1]


def test_generate_past_prompt_token_ids_is_keyword_only(worded):
    """Old vLLM's generate(prompts, params, prompt_token_ids, use_tqdm): a fourth positional argument was taken
    as `priority` (a TypeError about len(bool)); now Python names the misuse."""
    with pytest.raises(TypeError, match="positional argument"):
        worded.generate(None, GREEDY, [[3, 4]], False)
