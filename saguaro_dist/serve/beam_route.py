"""vLLM's served beam search (`use_beam_search` on /v1/completions and /v1/chat/completions): the request's
BeamSearchParams (vLLM's to_beam_search_params: n is the beam width), the search driven over the engine's async
stream, every live beam's one-token step concurrently (vLLM's entrypoints/generate/beam_search/online.py), and
the best beams as the n choices. The search rules are engine/beam_search.py's BeamRule, LLM.beam_search's too."""
from __future__ import annotations

import math

from saguaro_dist.engine.beam_search import (MAX_BEAM_WIDTH, BeamRule, BeamSearchInstance, BeamSearchParams,
                                             BeamSearchSequence, LiveRanking, beam_eos)
from saguaro_dist.engine.logprobs import RankedLogprobs
from saguaro_dist.serve import responses
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.full_replies import final_extra, finished_choice
from saguaro_dist.serve.route_support import ClosingStreamingResponse
from saguaro_dist.serve.fan_in import gather_or_cancel
from saguaro_dist.serve.state import Finished, Job, ServingState
from saguaro_dist.serve.tools import ToolChoiceKind

# Fields that would change a sampled reply but that vLLM's beam search leaves unread (its to_beam_search_params
# takes n, max_tokens, ignore_eos, temperature, length_penalty and include_stop_str_in_output): given past these
# inert values they are a 400 naming them, never silently dropped. seed is read by neither search and changes
# nothing (vLLM's takes it silently; OpenAI SDK users send one): taken here too
_INERT = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "stop": (None, "", []),
          "stop_token_ids": (None, []), "min_tokens": (0,), "presence_penalty": (None, 0.0),
          "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "logit_bias": (None, {}),
          "allowed_token_ids": (None,), "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
          "guided_choice": (None,), "guided_grammar": (None,), "bad_words": (None, []), "prompt_logprobs": (None,)}


def check_beam_request(body) -> None:
    """The 400s of a beam search request: n past the beam width limit, a field the search cannot honour, and
    (vLLM's) a streamed completions request."""
    if body.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search, got {body.n}",
                       param="n")
    for name, inert in _INERT.items():
        if getattr(body, name) not in inert:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with use_beam_search", param="response_format")
    if body.stream and not hasattr(body, "messages"):
        raise APIError(400, "Streaming is not currently supported with beam search", param="stream")
    options = body.stream_options
    if options is not None and options.continuous_usage_stats:  # the stream carries finished choices only
        raise APIError(400, "stream_options.continuous_usage_stats cannot be combined with use_beam_search",
                       param="stream_options")
    # echo's prompt scores, asked with logprobs (vLLM's search returns none); echo alone asks for none
    if body.echo and body.requested_logprobs() is not None:
        raise APIError(400, "echo with logprobs cannot be combined with use_beam_search", param="echo")
    if not math.isfinite(body.length_penalty):  # (BeamSearchParams' own check names its field, not the request's)
        raise APIError(400, f"length_penalty must be a finite number, got {body.length_penalty!r}",
                       param="length_penalty")
    if body.tool_plan().kind in (ToolChoiceKind.REQUIRED, ToolChoiceKind.NAMED):  # a constrained reply
        raise APIError(400, "a required or named tool_choice cannot be combined with use_beam_search",
                       param="tool_choice")


def beam_params(state: ServingState, body, job: Job) -> BeamSearchParams:
    """vLLM's to_beam_search_params: the temperature given, else the generation config's, else 1.0."""
    return BeamSearchParams(beam_width=body.n, max_tokens=job.params.max_tokens, ignore_eos=body.ignore_eos,
                            temperature=job.params.temperature, length_penalty=body.length_penalty,
                            include_stop_str_in_output=body.include_stop_str_in_output)


async def search(state: ServingState, rule: BeamRule, job: Job) -> list[BeamSearchSequence]:
    """One prompt's search: each step every live beam's one token through the engine, concurrently. A
    scores-only job (max_tokens 0 with echo) runs no step, as vLLM's search of 0 tokens: the prompt's beam."""
    if job.scores_only:  # (its job's one hidden token is the plain path's engine detail, not a beam step)
        return [BeamSearchSequence(list(job.prompt_ids), finish_reason="length")]
    instance, step = BeamSearchInstance.of_prompt(job.prompt_ids), rule.step_params()
    for number in range(rule.params.max_tokens):
        if not instance.beams:
            break
        jobs = [Job(beam.tokens, step, priority=job.priority, request_id=f"{job.request_id}-step{number}-beam{i}",
                    cache_salt=job.cache_salt, lora_request=job.lora_request)
                for i, beam in enumerate(instance.beams)]
        results = await gather_or_cancel([state.collect(j) for j in jobs])
        rule.step(instance, [r.logprobs[0] for r in results])
    return rule.best(instance)


def beam_result(state: ServingState, body, job: Job, beam: BeamSearchSequence, eos: int | None) -> Finished:
    """A beam as a finished choice, as vLLM's online search returns it: the generated tokens (an ending EOS only
    with include_stop_str_in_output), the text without the EOS, stop_reason the EOS id."""
    generated, entries = beam.tokens[len(job.prompt_ids):], beam.logprobs
    ended = beam.finish_reason == "stop"
    shown = generated[:-1] if ended else generated
    ids = generated if ended and body.include_stop_str_in_output else shown
    # (a parser's choice; without a tokenizer the text is "", as the search-free reply's)
    text = "" if state.tokenizer is None else state.tokenizer.decode(shown,
                                                                      skip_special_tokens=job.params.skip_special_tokens)
    entries = [beam_entry(token, entry) for token, entry in zip(ids, entries)]
    return Finished(text=text, token_ids=ids, finish_reason=beam.finish_reason, logprobs=entries,
                    stop_reason=eos if ended else None)


def beam_entry(token: int, entry: dict[int, float]) -> RankedLogprobs:
    """A step's entry re-keyed to the beam's token (the choice's logprobs read the first key as the chosen one),
    ranked as vLLM ranks it: the step's entry holds its top 2 * beam_width, where every beam's token comes from,
    so the tokens at least as likely are all in it (without the rank the token would be listed last, after the
    top N it belongs to)."""
    return RankedLogprobs({token: entry[token], **entry}, rank=sum(lp >= entry[token] for lp in entry.values()))


async def beam_results(state: ServingState, body, jobs: list[Job]) -> tuple[list[Job], list[Finished]]:
    """Every prompt's search (concurrently); its best beams are its choices, as many as it found (<= n)."""
    eos = beam_eos(state.tokenizer)
    firsts = jobs[::body.n]
    rules = [BeamRule(beam_params(state, body, job), eos, state.max_model_len, LiveRanking.CUM_LOGPROB)
             for job in firsts]
    found = await gather_or_cancel([search(state, rule, job) for rule, job in zip(rules, firsts)])
    pairs = [(job, beam_result(state, body, job, beam, eos))
             for k, beams in enumerate(found) for job, beam in zip(jobs[k * body.n:(k + 1) * body.n], beams)]
    return [job for job, _ in pairs], [result for _, result in pairs]


async def beam_response(state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format,
                        request_id: str, role: str, created: int | None = None):
    """The reply: whole, or (chat) vLLM's stream of the finished search: the role chunks, one chunk per choice
    with all its content and its finish_reason, the usage chunk if asked, [DONE]. `created`: the request's
    arrival (taken here, before the search, when not given), on the body and every chunk."""
    created = responses.arrival_time() if created is None else created
    check_beam_request(body)
    jobs, results = await beam_results(state, body, state.named(jobs, request_id))
    choices = [finished_choice(state, fmt, body, i, job, r, role) for i, (job, r) in enumerate(zip(jobs, results))]
    extra = final_extra(state, body, fmt, jobs, [r.token_ids for r in results], [None] * len(jobs))
    prompt_ids = {"prompt_token_ids": list(jobs[0].prompt_ids)} if fmt.chat and body.return_token_ids else {}
    if not body.stream:
        extra.update(prompt_ids)  # vLLM's return_token_ids: chat's beside the choices (completions': on each)
        return fmt.body(fmt.id_of(request_id), model, choices, created, **extra)
    events = _chat_events(body, fmt, fmt.id_of(request_id), model, choices, role, prompt_ids, created)
    if body.include_usage_chunk:
        events.append(fmt.chunk(fmt.id_of(request_id), model, [], created, usage=extra["usage"]))
    return ClosingStreamingResponse(_sse([*map(responses.sse, events), responses.sse("[DONE]")]),
                                    media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chat_events(body, fmt: responses.Format, response_id: str, model: str, choices: list[dict], role: str,
                 prompt_ids: dict | None = None, created: int | None = None) -> list:
    """The role chunks (with return_token_ids, the prompt's ids on each, as the search-free stream's), then one
    chunk per choice with its content and (return_token_ids) its token ids."""
    opening = [fmt.chunk(response_id, model, [fmt.chat_delta(c["index"], {"role": role, "content": ""}, None)],
                         created, **(prompt_ids or {})) for c in choices]
    deltas = [_delta_of(c["message"]) for c in choices]
    return opening + [fmt.chunk(response_id, model, [{**fmt.chat_delta(c["index"], delta, c["finish_reason"],
                                                                       c["logprobs"], c["stop_reason"]),
                                                      **({"token_ids": c["token_ids"]} if "token_ids" in c else {})}],
                                created)
                      for c, delta in zip(choices, deltas)]


def _delta_of(message: dict) -> dict:
    """A finished choice's message as one stream delta: its fields but the role, each tool call with its
    index (a chunk's tool calls need one, OpenAI's ChoiceDeltaToolCall)."""
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    return delta


async def _sse(parts: list[str]):
    yield "".join(parts)

