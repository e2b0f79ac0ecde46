"""A malformed completions prompt's 400 names the form the client meant and the item at fault, over real HTTP (the
serving app under uvicorn with the demo model). Old: prompt was a plain union, so pydantic reported its first
member for any bad prompt ("prompt: Input should be a valid string", for [1.5] as for 5)."""
from __future__ import annotations

import pytest
import test_responses_batch_review_fixes as responses_tests
from test_responses_batch_review_fixes import post

url = responses_tests.url  # the module fixture: the serving app on an ar demo engine, over uvicorn
NOT_A_PROMPT = "must be a string, a list of token ids, or a list of either"


def error_of(url: str, prompt) -> tuple[str, str]:
    reply = post(url, "/completions", {"prompt": prompt, "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error["message"], error["param"]


@pytest.mark.parametrize("prompt, message", [
    (5, f"prompt: {NOT_A_PROMPT}"),
    (None, f"prompt: {NOT_A_PROMPT}"),
    (True, f"prompt: {NOT_A_PROMPT}"),
    ({"text": "hi"}, f"prompt: {NOT_A_PROMPT}"),
    ([1.5], "prompt.0: Input should be a valid integer, got a number with a fractional part"),
    ([1, [2]], "prompt.1: Input should be a valid integer"),
    ([1, {"id": 2}], "prompt.1: Input should be a valid integer"),
    ([[1, "x"]], "prompt.0.1: Input should be a valid integer, unable to parse string as an integer"),
    ([[1], [2.5]], "prompt.1.0: Input should be a valid integer, got a number with a fractional part"),
    ([[1], "x"], "prompt.1: Input should be a valid list"),
    (["a", None], "prompt.1: Input should be a valid string"),
    ([None], "prompt.0: Input should be a valid string"),
])
def test_a_bad_prompt_is_named_by_its_form_and_path(url, prompt, message):
    assert error_of(url, prompt) == (message, message.split(": ")[0])


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""], [[1], []]])
def test_an_empty_prompt_is_still_refused(url, prompt):
    """vLLM refuses these too (an empty list: "please provide at least one prompt"; an empty text or token list
    reaches the engine as an empty decoder prompt)."""
    message, _ = error_of(url, prompt)
    assert message == "prompt must not be empty"


@pytest.mark.parametrize("prompt, same_as", [
    ("the cat", "the cat"), (["the", "cat"], ["the", "cat"]), ([5, 6], [5, 6]), ([[5, 6], [7]], [[5, 6], [7]]),
    (["5", 6], [5, 6]), ([5.0, "6"], [5, 6]), ([[5, "6"], [7.0]], [[5, 6], [7]]),
])
def test_valid_prompts_read_as_before(url, prompt, same_as):
    """Every form, including the ones lax JSON reading turns into token ids, generates as its plain form."""
    def texts(p):
        reply = post(url, "/completions", {"prompt": p, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return [choice["text"] for choice in reply.json()["choices"]]
    assert texts(prompt) == texts(same_as)
