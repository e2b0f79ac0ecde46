"""Whole (non-streamed) chat and completions replies, and what streamed ones share with them: a choice's
log-probabilities, the reasoning and echo shown, and the final usage and speculation stats."""
from __future__ import annotations

from saguaro_dist.serve import responses
from saguaro_dist.serve.chat_request import REPLY_ROLE
from saguaro_dist.serve.harmony import LiteralMarkers
from saguaro_dist.serve.reasoning import split_reasoning
from saguaro_dist.serve.fan_in import gather_or_cancel
from saguaro_dist.serve.state import Finished, Job, ServingState


def logprobs_of(state: ServingState, fmt: responses.Format, job: Job, entries: list | None, offset: int = 0):
    """A choice's `logprobs` object for generated tokens, or None when its request asked for none."""
    if job.params.logprobs is None or entries is None:
        return None
    return fmt.logprobs(state.tokenizer, [next(iter(e)) for e in entries], entries, job.params.logprobs, offset,
                        as_ids=job.tokens_as_ids)


def prompt_logprobs_of(state: ServingState, job: Job, result) -> list | None:
    """vLLM's prompt_logprobs of a choice, or None when its request asked for none."""
    if job.params.prompt_logprobs is None:
        return None
    return responses.prompt_logprobs(state.tokenizer, result.prompt_logprobs, job.params.prompt_logprobs)


def token_id_fields(state: ServingState, fmt: responses.Format, body, job: Job, token_ids: list[int],
                    with_prompt: bool) -> dict:
    """vLLM's return_token_ids on a choice: its (new) token_ids, and with_prompt a completion's prompt_token_ids
    (chat's are the response's or its first chunk's). None asked, none given; nor chat's token_ids where
    include_reasoning false hides reasoning a parser reads, which they would show (vLLM's rule)."""
    if not body.return_token_ids:
        return {}
    if fmt.chat and not body.include_reasoning and state.reasoning_parser_for(job) is not None:
        return {}
    return {"token_ids": list(token_ids), **({"prompt_token_ids": list(job.prompt_ids)} if with_prompt else {})}


def finished_choice(state: ServingState, fmt: responses.Format, body, index: int, job: Job, result, role: str) -> dict:
    """One finished choice (with vLLM's return_token_ids, its token ids)."""
    return {**_finished_choice(state, fmt, body, index, job, result, role),
            **token_id_fields(state, fmt, body, job, result.token_ids, with_prompt=not fmt.chat)}


def _finished_choice(state: ServingState, fmt: responses.Format, body, index: int, job: Job, result, role: str) -> dict:
    """One finished choice; with `echo` (completions) the prompt's text and log-probabilities lead."""
    if fmt.chat:
        plan = state.tool_plan_for(body)
        reasoning, text = split_reasoning(state.reasoning_parser_for(job), reply_text(state, result))
        content, calls = plan.parse(text)
        return fmt.choice(index, _echoed(body, role, content if content or reasoning is None else None),
                          plan.finish_reason(result.finish_reason, calls),
                          logprobs_of(state, fmt, job, result.logprobs), calls, shown(body, reasoning),
                          result.stop_reason, role=role)
    scored = prompt_logprobs_of(state, job, result)  # vLLM's: echo's too (also in logprobs, before the completion's)
    if not body.echo:  # completions' echo: the prompt leads
        return fmt.choice(index, result.text, result.finish_reason, logprobs_of(state, fmt, job, result.logprobs),
                          stop_reason=result.stop_reason, prompt_logprobs=scored)
    given = body.prompts()[index // body.n]  # the text as sent; a token-id prompt is decoded
    prompt = given if isinstance(given, str) else state.tokenizer.decode(job.prompt_ids)
    logprobs = None
    if job.params.logprobs is not None:
        ids = job.prompt_ids + [next(iter(e)) for e in result.logprobs or []]
        entries = (result.prompt_logprobs or [None] * len(job.prompt_ids)) + (result.logprobs or [])
        logprobs = fmt.logprobs(state.tokenizer, ids, entries, job.params.logprobs, as_ids=job.tokens_as_ids)
    return fmt.choice(index, prompt + result.text, result.finish_reason, logprobs, stop_reason=result.stop_reason,
                      prompt_logprobs=scored)


def reply_text(state: ServingState, result) -> str:
    """A finished chat reply's text for its parsers: a harmony server's with its literal marker text marked."""
    return LiteralMarkers.of(state.tokenizer).feed(result.text, result.token_ids) if state.harmony else result.text


def shown(body, reasoning: str | None) -> str | None:
    """The reasoning as the reply carries it: none when the request says include_reasoning false (vLLM's)."""
    return reasoning if body.include_reasoning else None


def _echoed(body, role: str, content: str | None) -> str | None:
    """A chat reply's content after what its `echo` repeats (the last message, when it is the reply's role)."""
    echoed = body.echoed(role)
    return echoed + (content or "") if echoed else content


async def full_response(state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format,
                        request_id: str, role: str = REPLY_ROLE, created: int | None = None) -> dict:
    """The whole reply once every choice has finished; `role` is a chat reply's (vLLM's get_chat_request_role),
    `created` the request's arrival."""
    # Cancelling this handler (client gone) cancels the generations, which abort in the engine; a choice
    # that fails (the engine refused it) ends the others too.
    results = await gather_or_cancel([state.collect(job) for job in jobs])
    results = [Finished(prompt_logprobs=r.prompt_logprobs, logprobs=[], finish_reason="length", metrics=r.metrics)
               if job.scores_only else r for job, r in zip(jobs, results)]
    choices = [finished_choice(state, fmt, body, i, job, r, role) for i, (job, r) in enumerate(zip(jobs, results))]
    extra = final_extra(state, body, fmt, jobs, [r.token_ids for r in results], [r.metrics for r in results])
    if fmt.chat:  # vLLM's: the one prompt's, beside the choices
        extra["prompt_logprobs"] = prompt_logprobs_of(state, jobs[0], results[0])
        if body.return_token_ids:
            extra["prompt_token_ids"] = list(jobs[0].prompt_ids)
    return fmt.body(fmt.id_of(request_id), model, choices, created, **extra)


def _prompt_tokens(jobs: list[Job], n: int) -> int:
    """Each prompt once, however many samples (n) it has, as OpenAI counts usage."""
    return sum(len(job.prompt_ids) for job in jobs[::n])


def _cached_tokens(metrics: list, n: int) -> int:
    """Counted as the prompts are: once per prompt (its first sample's)."""
    return sum(m.num_cached_tokens for m in metrics[::n] if m is not None)


def _reasoning_tokens(state: ServingState, fmt: responses.Format, jobs: list[Job], token_ids: list[list[int]]) -> int | None:
    """Chat's completion tokens that were reasoning, over every choice; None where usage leaves the figure
    out (completions, or a server without a reasoning parser)."""
    if not fmt.chat or state.reasoning_tokens is None:
        return None
    return sum(state.reasoning_count(job, ids) for job, ids in zip(jobs, token_ids))


def final_extra(state: ServingState, body, fmt: responses.Format, jobs: list[Job], token_ids: list[list[int]],
                metrics: list) -> dict:
    """A reply's usage and our speculation stats (streamed: usage on include_usage's closing chunk, speculation
    on the last finish_reason chunk)."""
    usage = responses.usage(_prompt_tokens(jobs, body.n), sum(map(len, token_ids)), _cached_tokens(metrics, body.n),
                            _reasoning_tokens(state, fmt, jobs, token_ids))
    return {"usage": usage,
            "speculation": responses.speculation(metrics, state.engine.config.mode.value)}
