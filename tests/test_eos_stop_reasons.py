"""A model's end ids as vLLM treats them (SamplingParams.update_from_generation_config): the tokenizer's EOS ends
a request with stop_reason None; the generation_config.json's other eos ids (Qwen3's <|endoftext|> beside
<|im_end|>, Llama-3's 128001 / 128008 beside 128009) are added to stop_token_ids, so one ends it with
stop_reason that id, unless ignore_eos; min_tokens holds every one of them back. AR, SD and SSD alike, with AR's
tokens. (min_tokens holds the eos ids back under ignore_eos too, as vLLM's: tests/test_min_tokens_ignore_eos.py.)"""
from __future__ import annotations

import httpx
import pytest
from transformers import GenerationConfig

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama


PROMPT = "the cat sat on the"
AT = 4  # the token a forced end lands on
MODES = ("ar", "sd", "ssd")
FORCE = 100.0  # a logit bias no other token beats


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str, int, int]:
    """(target, draft, eos, extra): the tokenizer's eos is `eos`; the target's generation_config.json lists
    [eos, extra], `extra` a plain word so that whether its text is kept shows."""
    tokenizer = make_tokenizer()
    target = write_llama(tmp_path_factory.mktemp("eos_target"), tokenizer, hidden=64, layers=2, seed=1)
    draft = write_llama(tmp_path_factory.mktemp("eos_draft"), tokenizer, hidden=32, layers=1, seed=2)
    eos, extra = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("mat")
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[eos, extra]).save_pretrained(target)
    return target, draft, eos, extra


@pytest.fixture(scope="module")
def engines(pair):
    target, draft = pair[:2]
    with (LLM(model=target, mode="ar", max_model_len=59) as ar,
          LLM(model=target, draft=draft, mode="sd", k=4, max_model_len=64) as sd,
          LLM(model=target, draft=draft, mode="ssd", k=4, max_model_len=64) as ssd):
        yield {"ar": ar, "sd": sd, "ssd": ssd}


def forced(token: int, max_tokens: int, **kw) -> SamplingParams:
    """`token` chosen whenever it may be: min_tokens holds it back for the first AT - 1 tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=AT - 1, logit_bias={token: FORCE}, **kw)


def in_every_mode(engines, params: SamplingParams, want: tuple[str, int | None], length: int):
    """Each mode ends as `want` (finish_reason, stop_reason) after `length` tokens; SD / SSD give AR's tokens and
    text. Returns AR's output."""
    outs = {m: engines[m].generate([PROMPT], params, use_tqdm=False)[0] for m in MODES}
    for mode, out in outs.items():
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == (*want, length), mode
        assert (out.token_ids, out.text) == (outs["ar"].token_ids, outs["ar"].text), mode
    return outs["ar"]


def test_the_tokenizers_eos_ends_with_no_stop_reason(engines, pair):
    eos = pair[2]
    for params in (forced(eos, 10), forced(eos, 10, stop_token_ids=[eos])):  # EOS is checked first
        out = in_every_mode(engines, params, ("stop", None), AT)
        assert eos not in out.token_ids[:-1] and out.token_ids[-1] == eos


def test_an_extra_eos_is_a_stop_token_id(engines, pair):
    extra = pair[3]
    for params in (forced(extra, 10), forced(extra, 10, stop_token_ids=[extra])):
        out = in_every_mode(engines, params, ("stop", extra), AT)
        assert extra not in out.token_ids[:-1] and out.token_ids[-1] == extra
        assert "mat" not in out.text  # the ending token is not text, as an EOS's


def test_ignore_eos_goes_on_past_both(engines, pair):
    """ignore_eos: neither id ends the request (no min_tokens here: see tests/test_min_tokens_ignore_eos.py)."""
    for token in pair[2:]:
        params = SamplingParams(temperature=0, max_tokens=AT, logit_bias={token: FORCE}, ignore_eos=True)
        out = in_every_mode(engines, params, ("length", None), AT)
        assert out.token_ids == [token] * AT
    assert out.text.endswith("mat")  # the extra eos's text is kept where it ends nothing


def test_ignore_eos_keeps_the_requests_own_stop_token_ids(engines, pair):
    for token in pair[2:]:
        in_every_mode(engines, forced(token, AT + 2, ignore_eos=True, stop_token_ids=[token]), ("stop", token), AT)


def test_the_servers_stop_reason(engines, pair):
    eos, extra = pair[2:]
    with serve_on_loopback(create_app(engines["ar"], ServerOptions("m"))) as url:
        def reason(path: str, token: int, **body) -> tuple[str, int | None]:
            reply = httpx.post(f"{url}/{path}", json={"model": "m", "max_tokens": 10, "temperature": 0,
                                                      "min_tokens": AT - 1, "logit_bias": {str(token): FORCE}, **body},
                               timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            return choice["finish_reason"], choice["stop_reason"]

        chat = {"messages": [{"role": "user", "content": PROMPT}]}
        for path, body in (("completions", {"prompt": PROMPT}), ("chat/completions", chat)):
            assert reason(path, extra, **body) == ("stop", extra), path
            assert reason(path, eos, **body) == ("stop", None), path


def test_which_generation_config_is_read(pair, tmp_path):
    from saguaro_dist.engine.build import generation_eos_ids
    target = pair[0]
    assert generation_eos_ids(Config(model=target, mode="ar")) == (pair[2], pair[3])
    assert generation_eos_ids(Config(model=target, mode="ar", generation_config="vllm")) == (pair[2], pair[3])  # eos still read
    GenerationConfig(eos_token_id=7).save_pretrained(tmp_path)
    assert generation_eos_ids(Config(model=target, mode="ar", generation_config=str(tmp_path))) == (7,)
    assert generation_eos_ids(Config(model=pair[1], mode="ar")) == (pair[2],)  # transformers' file, from config.json


def rewrite_json(path, **fields) -> None:
    import json
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **fields}))


def test_a_generation_config_naming_no_eos_adds_no_end_ids(pair, tmp_path):
    """A generation_config.json without eos_token_id: vLLM then adds no stop ids (config.json's eos stands in
    only where there is no file), so config.json's extra id ends nothing; only the tokenizer's EOS does."""
    import shutil
    from pathlib import Path
    target = Path(shutil.copytree(pair[0], tmp_path / "target"))
    rewrite_json(target / "config.json", eos_token_id=[pair[2], pair[3]])
    (target / "generation_config.json").write_text('{"temperature": 1.0}')
    with LLM(model=str(target), mode="ar", max_model_len=64) as llm:
        assert set(llm.eos_token_ids) == {pair[2]}
        params = SamplingParams(temperature=0, max_tokens=6, logit_bias={pair[3]: FORCE})
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert (out.finish_reason, len(out.token_ids)) == ("length", 6)


@pytest.mark.parametrize("eos", ["5", True, [[5]], -1])
def test_a_generation_config_eos_that_is_no_token_id_is_refused(pair, tmp_path, eos):
    import shutil
    from pathlib import Path
    target = Path(shutil.copytree(pair[0], tmp_path / "target"))
    rewrite_json(target / "generation_config.json", eos_token_id=eos)
    with pytest.raises(ValueError, match="eos_token_id must be a token id >= 0"):
        LLM(model=str(target), mode="ar", max_model_len=64)
