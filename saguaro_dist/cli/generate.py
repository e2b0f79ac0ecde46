"""`saguaro generate PROMPT ...`: one-off generation, in-process or against a running server (--url)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from saguaro_dist.cli.flag_checks import check_url, refuse_with_url, refuse_without
from saguaro_dist.cli.serve import ENGINE_FLAGS, add_engine_args, engine_args, generation_defaults
from saguaro_dist.cli.stdout import stdout_to_devnull

# generate's own defaults where the model's generation config sets none (the other fields: SamplingParams')
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}


@dataclass(frozen=True)
class Choice:
    """One sample of a server's completion (an OpenAI choice), read as a local CompletionOutput is."""
    index: int
    text: str
    finish_reason: str | None


def register(subparsers) -> None:
    """`saguaro generate`: the engine flags (serve's), then sampling, structured-output and output groups;
    the groups' order is --help's."""
    p = subparsers.add_parser("generate", help="generate text for one-off prompts",
                              description="Generate for each PROMPT (or each line of stdin when none is given) "
                                          "with an in-process engine, or with a running server via --url.")
    p.add_argument("--prompt", action="append", default=[], metavar="PROMPT",
                   help="a prompt (repeatable); stdin lines when no prompt is given")
    add_engine_args(p)
    _add_sampling_args(p)
    _add_structured_output_args(p)
    _add_output_args(p)
    p.set_defaults(run=run)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """No defaults here (but --n's): a flag left out must be told from one given, so that the model's
    generation config, or the server's, fills it (generation_defaults)."""
    g = p.add_argument_group("sampling", "a flag left out takes the model's generation_config.json value "
                             "(--generation-config), else the default shown; with --url, the server's default")
    g.add_argument("--max-tokens", type=int, help="(default 64)")
    g.add_argument("--temperature", type=float, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, help="(default 1: off)")
    g.add_argument("--top-k", type=int, help="(default 0: off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min-p x the likeliest's probability (default 0: off)")
    g.add_argument("--seed", type=int)
    g.add_argument("--n", type=_sample_count, default=1, metavar="N",
                   help="samples per prompt (default 1); sample i of a seeded request draws from seed + i. With "
                        "N > 1 each prompt's samples print as '[i] text' lines in index order (--json: under "
                        "\"choices\")")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, help="-2..2, on tokens already in the output (default 0)")
    g.add_argument("--frequency-penalty", type=float, help="-2..2, times a token's count in the output (default 0)")
    g.add_argument("--repetition-penalty", type=float,
                   help="> 0; > 1 discourages prompt and output tokens (default 1)")
    g.add_argument("--logit-bias", action="append", type=_bias_pair, metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--allowed-token-ids", type=_token_ids, metavar="ID,ID,...", help="only these tokens may be generated")


def _add_structured_output_args(p: argparse.ArgumentParser) -> None:
    """One of these at most (StructuredOutputsParams refuses more)."""
    s = p.add_argument_group("structured outputs (one of)")
    s.add_argument("--json-schema", type=_json_schema, metavar="SCHEMA", help="JSON following this schema (JSON text)")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", help="text matching this regular expression")
    s.add_argument("--choice", action="append", help="one of these strings (repeatable)")
    s.add_argument("--grammar", help="text in this grammar (Lark or GBNF)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """How results print, and --url: a server does the generating instead."""
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per prompt, with speculation metrics")
    o.add_argument("--url", help="use this OpenAI-compatible server instead of loading the model (its engine: the "
                                 "engine flags but MODEL / --model, the name asked for, are refused)")
    o.add_argument("--api-key", help="API key for --url")


def run(ns: argparse.Namespace) -> int:
    _check_flags(ns)
    if not ns.prompt and sys.stdin is None:  # started with stdin closed (`<&-`): Python sets it to None
        raise ValueError("no prompt given (--prompt TEXT), and stdin is closed")
    if sys.stdout is None:  # `>&-`: the results' write was an AttributeError's stack trace, after the generation
        raise ValueError("stdout is closed: there is nowhere to print the results")
    prompts = ns.prompt or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]  # CRLF files too
    if not prompts:
        raise ValueError("no prompt given (--prompt TEXT, or lines on stdin)")
    if "" in prompts:  # refused here, not after the model loads (an empty prompt has no token to continue from)
        raise ValueError("--prompt is empty: give the text to continue")
    results = _remote(ns, prompts) if ns.url else _local(ns, prompts)
    return _print(results, ns.json)


def _print(results: list[dict], as_json: bool) -> int:
    """0, or 1 where the reader went away (`| head -1`): quietly, as Unix tools stop (a BrokenPipeError's
    stack trace before)."""
    try:
        for result in results:
            sys.stdout.write(json.dumps(result) + "\n" if as_json else _plain(result))
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_devnull()  # the interpreter's flush at exit would print its own error
        return 1
    return 0



def _plain(result: dict) -> str:
    """One sample: its text, as before --n; several: each on a line of its own labelled by its index."""
    if "choices" not in result:
        return result["text"] + "\n"
    return "".join(f"[{c['index']}] {c['text']}\n" for c in result["choices"])


def _check_flags(ns: argparse.Namespace) -> None:
    """Flags this run would leave unused: the key without --url, the engine's flags with it (the server runs
    its own; MODEL or --model names the model asked for)."""
    check_url(ns.url)
    refuse_without(ns, ("api_key",), "url")
    refuse_with_url(ns, [d for d in ENGINE_FLAGS if d != "model"], "the server runs its own engine")


def _sampling(ns: argparse.Namespace) -> dict:
    """The sampling flags given: the rest are left to the model's generation config (or the server's defaults)."""
    fields = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k,
              "min_p": ns.min_p, "seed": ns.seed, "stop": ns.stop, "presence_penalty": ns.presence_penalty,
              "frequency_penalty": ns.frequency_penalty, "repetition_penalty": ns.repetition_penalty,
              "logit_bias": dict(ns.logit_bias) if ns.logit_bias else None, "allowed_token_ids": ns.allowed_token_ids,
              "structured_outputs": _structured(ns), "n": ns.n if ns.n != 1 else None}  # (n = 1: the body as before)
    return {k: v for k, v in fields.items() if v is not None}


def _structured(ns: argparse.Namespace) -> dict | None:
    """vLLM's structured_outputs body from the flags given (StructuredOutputsParams checks there is one)."""
    given = {"json": ns.json_schema, "json_object": ns.json_object or None, "regex": ns.regex, "choice": ns.choice,
             "grammar": ns.grammar}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def _json_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON schema as JSON text: {err}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("expected a JSON schema (an object)")
    return schema


def _bias_pair(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (say 42=-100), got {text!r}") from None


def _sample_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (samples per prompt), got {text!r}")
    return n


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas (say 5,9,12), got {text!r}") from None


def _local(ns: argparse.Namespace, prompts: list[str]) -> list[dict]:
    from saguaro_dist import LLM
    from saguaro_dist.serve.args import config_from_args

    config = config_from_args(engine_args(ns))  # (more than one rank or draft worker: on Ray, cluster auto)
    params = _params({**GENERATE_DEFAULTS, **generation_defaults(config), **_sampling(ns)})  # before the model loads
    with LLM.from_config(config) as llm:
        outputs = llm.generate(prompts, params)
    return [_result(o.prompt, o.outputs, o.metrics.to_dict(), params.n) for o in outputs]


def _result(prompt: str, choices: list, metrics: dict | None, n: int) -> dict:
    """One prompt's JSON line: with one sample its text and finish_reason (as before --n), with several each
    sample's under "choices" (index, text, finish_reason). metrics: the local engine's sample 0's, or the
    server's speculation stats (over every choice)."""
    if n == 1:
        return {"prompt": prompt, "text": choices[0].text, "finish_reason": choices[0].finish_reason, "metrics": metrics}
    samples = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason} for c in choices]
    return {"prompt": prompt, "choices": samples, "metrics": metrics}


def _params(sampling: dict):
    from saguaro_dist import SamplingParams
    from saguaro_dist.sampling_params import StructuredOutputsParams

    if "structured_outputs" in sampling:
        sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
    return SamplingParams(**sampling)


def _remote(ns: argparse.Namespace, prompts: list[str]) -> list[dict]:
    from saguaro_dist.client import Client, SaguaroError
    from saguaro_dist.client._common import served_api_root

    with Client(served_api_root(ns.url), api_key=ns.api_key, model=ns.model or ns.model_tag) as client:
        try:
            outs = [client.complete(p, **_sampling(ns)) for p in prompts]
        except SaguaroError as err:  # the server's message, as a clean CLI error
            raise ValueError(str(err)) from None
    return [_result(p, _choices(o, ns.n), o.speculation, ns.n) for p, o in zip(prompts, outs)]


def _choices(completion, n: int) -> list:
    """A completion's n choices in index order (the server may list them in any order)."""
    if n == 1:
        return [completion]
    choices = sorted(completion.raw.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise ValueError(f"the server answered {len(choices)} choices for --n {n}")
    return [Choice(c.get("index", i), c.get("text") or "", c.get("finish_reason")) for i, c in enumerate(choices)]
