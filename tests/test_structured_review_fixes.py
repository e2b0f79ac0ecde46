"""Structured outputs as vLLM takes them: a `grammar` in GBNF (llama.cpp's, vLLM's documented form) as well
as Lark, followed alike by ar / sd / ssd (the draft compiling it too); and with a reasoning parser, a JSON
schema the plain server refuses with a 400 is refused with the same 400, not a 500 (real HTTP)."""
from __future__ import annotations

import re

import httpx
import pytest
from transformers import AutoTokenizer

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.draft_constraints import DraftConstraints
from saguaro_dist.engine.structured import GrammarCompiler, grammar_of
from saguaro_dist.sampling_params import StructuredOutputsParams as SO
from saguaro_dist.serve.api import ServerOptions, create_app

# vLLM's structured outputs docs' SQL grammar (GBNF), and the language it describes.
SQL_GBNF = '''root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
'''
SQL = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
LARK = 'start: "SELECT " COLUMN\nCOLUMN: "col_1" | "col_2"\n'


@pytest.fixture(scope="module")
def compiler():
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


@pytest.mark.parametrize("grammar", [SQL_GBNF, LARK])
def test_gbnf_and_lark_grammars_compile(compiler, grammar):
    compiler.check(SamplingParams(structured_outputs=SO(grammar=grammar)))


@pytest.mark.parametrize("grammar", ['root ::= "a" missing', 'root ::= ("a"', 'start: "a" missing'])
def test_a_bad_grammar_is_still_refused(compiler, grammar):
    with pytest.raises(ValueError, match="structured_outputs is not valid"):
        compiler.check(SamplingParams(structured_outputs=SO(grammar=grammar)))


def test_the_draft_compiles_a_gbnf_grammar_as_the_target_does():
    """The draft is told grammar_of's text: it follows it (None would mean it proposes unconstrained)."""
    target, draft = demo_pair()
    constraints = DraftConstraints(len(AutoTokenizer.from_pretrained(draft)), lambda: AutoTokenizer.from_pretrained(draft))
    assert constraints.grammar_state(grammar_of(SO(grammar=SQL_GBNF)), []) is not None


@pytest.mark.slow
def test_a_gbnf_grammar_is_followed_alike_by_every_mode():
    target, draft = demo_pair()
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=SO(grammar=SQL_GBNF))
    outs = {}
    for mode in ("ar", "sd", "ssd"):
        with LLM(model=target, draft=None if mode == "ar" else draft, mode=mode, k=4, draft_executor="thread") as llm:
            outs[mode] = llm.generate(["def query(db):\n    return "], params)[0]
    assert outs["sd"].token_ids == outs["ar"].token_ids == outs["ssd"].token_ids
    assert re.fullmatch(SQL, outs["ar"].text), outs["ar"].text


@pytest.fixture(scope="module")
def servers():
    """The demo model served plainly and with each reasoning parser that nests a request's constraint."""
    llm = LLM(model=demo_pair()[0], mode="ar")
    apps = [create_app(llm, ServerOptions("demo", reasoning_parser=p)) for p in (None, "qwen3", "openai_gptoss")]
    with serve_on_loopback(apps[0]) as plain, serve_on_loopback(apps[1]) as qwen3, serve_on_loopback(apps[2]) as harmony:
        yield {"plain": plain, "qwen3": qwen3, "openai_gptoss": harmony}
    llm.shutdown()


def _chat(url: str, spec: dict) -> httpx.Response:
    return httpx.post(url + "/chat/completions", timeout=60, json={
        "model": "demo", "max_tokens": 4, "temperature": 0, "structured_outputs": spec,
        "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.slow
@pytest.mark.parametrize("schema", ["true", "[1]", "{bad"])
def test_a_bad_schema_gets_the_plain_400_with_a_reasoning_parser(servers, schema):
    errors = {}
    for name, url in servers.items():
        reply = _chat(url, {"json": schema})
        assert reply.status_code == 400, (name, reply.text)
        errors[name] = reply.json()["error"]
    assert errors["plain"]["message"].startswith("structured_outputs is not valid: ")
    assert errors["plain"]["param"] == "structured_outputs"
    assert errors["qwen3"] == errors["openai_gptoss"] == errors["plain"]


@pytest.mark.slow
def test_x_guidance_that_is_not_an_object_is_read_as_the_plain_server_reads_it(servers):
    """llguidance ignores such options (our JSON defaults apply): the reason-first grammar reads them alike."""
    for name in ("plain", "qwen3"):
        reply = _chat(servers[name], {"json": '{"type": "object", "x-guidance": 5}'})
        assert reply.status_code == 200, (name, reply.text)
