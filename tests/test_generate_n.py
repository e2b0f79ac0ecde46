"""`saguaro generate --n N`: N samples per prompt in-process and from a server (--url sends n), each printed
labelled by its index ('[i] text'; --json: under "choices"), the samples LLM.generate makes for the same
params (sample i seeded seed + i, the server's rule too); one sample prints as before; N < 1 exits 2."""
from __future__ import annotations

import json

import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import main
from test_serve_fixtures import make_tokenizer, write_llama

PROMPTS = ["the cat sat", "hello world"]
SAMPLED = ["--temperature", "1.0", "--seed", "9", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama(tmp_path_factory.mktemp("h1n_cli"), make_tokenizer(), hidden=32, layers=1, seed=5)


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model=model, mode="ar") as engine:
        yield engine


@pytest.fixture(scope="module")
def url(llm):
    from saguaro_dist.serve.api import ServerOptions, create_app
    with serve_on_loopback(create_app(llm, ServerOptions("m"))) as address:
        yield address


def samples(llm: LLM, n: int) -> list[list[str]]:
    """Each prompt's sample texts, as LLM.generate makes them for SAMPLED's params."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=9, max_tokens=6, n=n), use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outs]


def generate(argv: list[str], capsys) -> str:
    assert main(["generate", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *SAMPLED, *argv]) == 0
    return capsys.readouterr().out


def labelled(texts: list[list[str]]) -> str:
    return "".join(f"[{i}] {text}\n" for prompt in texts for i, text in enumerate(prompt))


@pytest.fixture(params=["local", "url"])
def where(request, model, url) -> list[str]:
    return [model, "--mode", "ar"] if request.param == "local" else ["--url", url]


def test_n_samples_print_labelled_by_index(where, llm, capsys):
    want = samples(llm, 3)
    assert all(len(set(texts)) > 1 for texts in want)  # the samples differ: the labels matter
    assert generate([*where, "--n", "3"], capsys) == labelled(want)


def test_n_samples_as_json_choices(where, llm, capsys):
    lines = [json.loads(line) for line in generate([*where, "--n", "2", "--json"], capsys).splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS and all("metrics" in line for line in lines)
    assert [[c["index"] for c in line["choices"]] for line in lines] == [[0, 1]] * 2
    assert [[c["text"] for c in line["choices"]] for line in lines] == samples(llm, 2)
    assert {c["finish_reason"] for line in lines for c in line["choices"]} <= {"stop", "length"}


def test_one_sample_prints_as_before(where, llm, capsys):
    """--n 1 (the default): the text alone, and --json's flat text / finish_reason (no choices)."""
    want = [texts[0] for texts in samples(llm, 1)]
    assert generate(where, capsys) == generate([*where, "--n", "1"], capsys) == "".join(t + "\n" for t in want)
    lines = [json.loads(line) for line in generate([*where, "--json"], capsys).splitlines()]
    assert [line["text"] for line in lines] == want and not any("choices" in line for line in lines)


@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "two"])
def test_n_below_one_exits_2(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--n", bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--n: expected an integer >= 1 (samples per prompt)" in err
