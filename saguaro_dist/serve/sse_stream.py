"""Streamed (SSE) chat and completions replies: the engine's deltas, batched per write, as OpenAI's chunks."""
from __future__ import annotations

from contextlib import aclosing

from saguaro_dist.serve import responses
from saguaro_dist.serve.chat_request import REPLY_ROLE
from saguaro_dist.serve.errors import stream_error
from saguaro_dist.serve.full_replies import final_extra, logprobs_of, shown, token_id_fields
from saguaro_dist.serve.harmony import LiteralMarkers
from saguaro_dist.serve.reasoning import ReasoningStream
from saguaro_dist.serve.route_support import ClosingStreamingResponse
from saguaro_dist.serve.fan_in import merge
from saguaro_dist.serve.state import Job, ServingState
from saguaro_dist.serve.tools import ToolStream


async def stream_response(state: ServingState, body, jobs: list[Job], model: str, fmt, request_id: str,
                          role: str = REPLY_ROLE, created: int | None = None) -> ClosingStreamingResponse:
    """The reply as SSE; `role` is a chat reply's, sent in the first delta (vLLM's); `created`, the request's
    arrival, is every chunk's."""
    batches = merge([state.stream(job) for job in jobs], state.stream_interval_s, lambda d: bool(d.text) or d.finished)
    # Wait for the first delta before answering, so a request the engine rejects still gets a 400.
    first = await anext(batches, None)
    events = _SseEvents(state, body, jobs, model, fmt, fmt.id_of(request_id), role,
                        responses.arrival_time() if created is None else created)
    chunks = _sse_chunks(events, batches, first)
    return ClosingStreamingResponse(chunks, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_chunks(events, batches, first):
    pending = events.opening()  # the chat role chunk leaves with the first text: one write fewer
    try:
        async with aclosing(batches):
            batch = first
            while batch is not None:
                pending += events.of(batch)
                if events.done:  # the last text, usage and [DONE] in one write
                    pending += events.closing()
                if pending:
                    yield pending
                    pending = ""
                batch = await anext(batches, None)
    except Exception as err:  # noqa: BLE001 - headers are sent: the error travels as an event, like vLLM's
        yield responses.sse(stream_error(err)) + responses.sse("[DONE]")
        return
    if not events.done:  # the streams ended without every choice finishing (cannot happen unless aborted)
        yield pending + events.closing()


class _SseEvents:
    """The SSE text of one streamed response: one write per batch of deltas, each write one trip
    through Serve's streaming path (~1.4 ms of replica CPU on the engine's GIL, docs/serving.md)."""

    def __init__(self, state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format, response_id: str,
                 role: str, created: int):
        self.state, self.body, self.jobs, self.model, self.fmt = state, body, jobs, model, fmt
        self.request_id, self.role = response_id, role  # role: a chat reply's, in its first delta
        self.created = created  # one `created` for every chunk (OpenAI's, vLLM's)
        self.token_ids: list[list[int]] = [[] for _ in jobs]  # generated per choice: usage counts them
        self.metrics, self.finished = [None] * len(jobs), 0
        # Log-probabilities of tokens whose text is held back (a possible stop string) wait for its chunk.
        self.pending_logprobs: list[list] = [[] for _ in jobs]
        self.pending_ids: list[list[int]] = [[] for _ in jobs]  # so do their token ids (return_token_ids)
        self.prompt_ids_sent = [False] * len(jobs)  # a completion's prompt_token_ids ride on its first chunk
        self.text_sent = [0] * len(jobs)  # per choice, the legacy text_offset: its sent tokens' own texts' length
        self.tool_streams = [ToolStream(state.tool_plan_for(body)) for _ in jobs]  # chat: content and tool-call deltas
        self.reasoning_streams = [ReasoningStream(state.reasoning_parser_for(job)) for job in jobs]  # chat
        # a harmony chat's text: marker text its ids did not write is marked literal (harmony.LiteralMarkers)
        self.literal_marks = [LiteralMarkers.of(state.tokenizer) if state.harmony and fmt.chat else None for _ in jobs]

    @property
    def done(self) -> bool:
        return self.finished == len(self.jobs)

    def opening(self) -> str:
        if not self.fmt.chat:
            return ""
        deltas = [{"role": self.role, "content": ""}]
        if self.body.echoed(self.role):  # vLLM's echo: the repeated last message is the first content delta
            deltas.append({"content": self.body.echoed(self.role)})
        return "".join(responses.sse(self.fmt.chunk(self.request_id, self.model, [self.fmt.chat_delta(i, delta, None)],
                                                    self.created, **self._running_usage(i), **self._prompt_ids(delta)))
                       for delta in deltas for i in range(len(self.jobs)))

    def _prompt_ids(self, delta: dict) -> dict:
        """vLLM's return_token_ids: chat's prompt ids ride on each choice's role chunk, the stream's first."""
        if not (self.body.return_token_ids and "role" in delta):
            return {}
        return {"prompt_token_ids": list(self.jobs[0].prompt_ids)}

    def _running_usage(self, index: int) -> dict:
        """vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's usage so far."""
        options = self.body.stream_options
        if not (options and options.include_usage and options.continuous_usage_stats):
            return {}
        return {"usage": responses.running_usage(len(self.jobs[index].prompt_ids), len(self.token_ids[index]))}

    def of(self, batch) -> str:
        events = []
        for index, text, ids, last, logprobs in per_choice(batch):
            self.token_ids[index] += ids
            self.pending_logprobs[index] += logprobs
            self.pending_ids[index] += ids
            extra = {}
            if last.finished:
                self.metrics[index], self.finished = last.metrics, self.finished + 1
                if self.done:  # our speculation stats; usage only when asked (closing), as OpenAI and vLLM send it
                    extra = {"speculation": self._final()["speculation"]}
            marks = self.literal_marks[index]
            choice = self._choice(index, marks.feed(text, ids) if marks else text, last)
            if choice is not None:
                choice = {**choice, **self._take_token_ids(index)}
                extra = {**extra, **self._running_usage(index)}  # the request's usage follows in its own chunk
                events.append(responses.sse(self.fmt.chunk(self.request_id, self.model, [choice], self.created, **extra)))
        return "".join(events)

    def _choice(self, index: int, text: str, last) -> dict | None:
        """This batch's choice for one index, or None when it has nothing to send yet."""
        reason = last.finish_reason if last.finished else None
        stop_reason = last.stop_reason if last.finished else None
        if not self.fmt.chat:
            if not (text or last.finished):
                return None
            return self.fmt.delta_choice(index, text, reason, self._take_logprobs(index), stop_reason)
        tools = self.tool_streams[index]
        reasoning, text = self.reasoning_streams[index].feed(text, last.finished)
        delta = {**({"reasoning": reasoning} if shown(self.body, reasoning) else {}), **tools.step(text, last.finished)}
        if not (delta or last.finished):
            return None  # text held back (a tool call may be starting): its log-probabilities wait too
        reason = tools.plan.finish_reason(reason, tools.calls) if last.finished else None
        return self.fmt.chat_delta(index, delta, reason, self._take_logprobs(index), stop_reason)

    def _take_token_ids(self, index: int) -> dict:
        """vLLM's return_token_ids on a chunk's choice: the ids of the tokens it brings (and, on a completion's
        first chunk, its prompt's)."""
        ids, self.pending_ids[index] = self.pending_ids[index], []
        first, self.prompt_ids_sent[index] = not self.prompt_ids_sent[index], True
        return token_id_fields(self.state, self.fmt, self.body, self.jobs[index], ids,
                               with_prompt=first and not self.fmt.chat)

    def _take_logprobs(self, index: int) -> dict | None:
        """The log-probabilities of the tokens this chunk brings: every token whose text has started, though
        part of it may be held back (a possible stop string); so text_offset counts the tokens' own texts, as
        the whole reply's does, not the chunks' text (which lagged: offsets overlapped, or went back)."""
        entries, self.pending_logprobs[index] = self.pending_logprobs[index], []
        offset = self.text_sent[index]
        if entries and not self.fmt.chat:
            ids = [next(iter(e)) for e in entries]
            self.text_sent[index] += sum(map(len, responses.token_texts(self.state.tokenizer, ids)))
        return logprobs_of(self.state, self.fmt, self.jobs[index], entries, offset)

    def _final(self) -> dict:
        return final_extra(self.state, self.body, self.fmt, self.jobs, self.token_ids, self.metrics)

    def closing(self) -> str:
        """OpenAI's stream_options.include_usage: one more chunk, no choices, the only one with the request's usage
        (a client summing usage over chunks, as LangChain does, counts it once), then [DONE]."""
        events = ""
        if self.body.include_usage_chunk:
            events += responses.sse(self.fmt.chunk(self.request_id, self.model, [], self.created,
                                                   usage=self._final()["usage"]))
        return events + responses.sse("[DONE]")


def per_choice(batch: list[tuple[int, object]]) -> list[tuple[int, str, list[int], object, list]]:
    """A batch's deltas joined per choice: (index, text, token ids, the last delta, logprob entries)."""
    grouped: dict[int, list] = {}
    for index, delta in batch:
        grouped.setdefault(index, []).append(delta)
    return [(i, "".join(d.text for d in ds), [t for d in ds for t in d.token_ids], ds[-1],
             [e for d in ds for e in (d.logprobs or [])]) for i, ds in grouped.items()]
