"""`saguaro generate PROMPT ...`: one-off generation, in-process or against a running server (--url)."""
from __future__ import annotations

import argparse
import json
import sys

from saguaro_dist.cli.serve import add_engine_args, engine_args


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one-off prompts",
                              description="Generate for each PROMPT (or each line of stdin when none is given) "
                                          "with an in-process engine, or with a running server via --url.")
    p.add_argument("--prompt", action="append", default=[], metavar="PROMPT",
                   help="a prompt (repeatable); stdin lines when no prompt is given")
    add_engine_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the likeliest's probability (0: off)")
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, on tokens already in the output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, times a token's count in the output")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; > 1 discourages prompt and output tokens")
    g.add_argument("--logit-bias", action="append", type=_bias_pair, metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--allowed-token-ids", type=_token_ids, metavar="ID,ID,...", help="only these tokens may be generated")
    s = p.add_argument_group("structured outputs (one of)")
    s.add_argument("--json-schema", type=_json_schema, metavar="SCHEMA", help="JSON following this schema (JSON text)")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", help="text matching this regular expression")
    s.add_argument("--choice", action="append", help="one of these strings (repeatable)")
    s.add_argument("--grammar", help="text in this Lark grammar")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per prompt, with speculation metrics")
    o.add_argument("--url", help="use this OpenAI-compatible server instead of loading the model")
    o.add_argument("--api-key", help="API key for --url")
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt given (--prompt TEXT, or lines on stdin)")
    results = _remote(ns, prompts) if ns.url else _local(ns, prompts)
    for result in results:
        sys.stdout.write(json.dumps(result) + "\n" if ns.json else result["text"] + "\n")
    return 0


def _sampling(ns: argparse.Namespace) -> dict:
    return {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k,
            "min_p": ns.min_p, "seed": ns.seed, "stop": ns.stop, "presence_penalty": ns.presence_penalty,
            "frequency_penalty": ns.frequency_penalty, "repetition_penalty": ns.repetition_penalty,
            "logit_bias": dict(ns.logit_bias) if ns.logit_bias else None, "allowed_token_ids": ns.allowed_token_ids,
            "structured_outputs": _structured(ns)}


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


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas (say 5,9,12), got {text!r}") from None


def _local(ns: argparse.Namespace, prompts: list[str]) -> list[dict]:
    from saguaro_dist import LLM, SamplingParams
    from saguaro_dist.config import Config

    from saguaro_dist.sampling_params import StructuredOutputsParams

    sampling = {k: v for k, v in _sampling(ns).items() if v is not None}
    if "structured_outputs" in sampling:
        sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
    params = SamplingParams(**sampling)
    with LLM.from_config(Config(**engine_args(ns))) as llm:
        outputs = llm.generate(prompts, params)
    return [{"prompt": o.prompt, "text": o.text, "finish_reason": o.finish_reason, "metrics": o.metrics.to_dict()}
            for o in outputs]


def _remote(ns: argparse.Namespace, prompts: list[str]) -> list[dict]:
    from saguaro_dist.client import Client, SaguaroError

    with Client(ns.url, api_key=ns.api_key, model=ns.model or ns.model_tag) as client:
        try:
            outs = [client.complete(p, **_sampling(ns)) for p in prompts]
        except SaguaroError as err:  # the server's message, as a clean CLI error
            raise ValueError(str(err)) from None
    return [{"prompt": p, "text": o.text, "finish_reason": o.finish_reason, "metrics": o.speculation}
            for p, o in zip(prompts, outs)]
