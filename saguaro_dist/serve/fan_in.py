"""Fan-in for the routes: several generations awaited as one (gather_or_cancel), or several streams read as
one (merge), where a failure or a client gone cancels every other one, so no generation runs on for a
request already answered."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

# The message of the CancelledError a generation gets when a sibling failed: the request is answered with that
# failure, so its cancellation is no client hang-up (ServingState.stream counts those).
SIBLING_FAILED = "a sibling generation failed"


def cancelled_by_sibling(err: BaseException) -> bool:
    """Whether err is the cancellation fan-in sent because another generation of the request failed."""
    return isinstance(err, asyncio.CancelledError) and SIBLING_FAILED in err.args


async def gather_or_cancel(coroutines: list) -> list:
    """asyncio.gather's results, except that when one fails the others are cancelled (and waited for)
    before its exception propagates: gather alone left them generating for a request already answered."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except Exception:
        await _cancel_all(tasks, SIBLING_FAILED)
        raise
    finally:
        await _cancel_all(tasks)  # (a cancelled request: gather cancelled them already)


async def _cancel_all(tasks: list[asyncio.Task], why: str | None = None) -> None:
    """Cancel the tasks and wait until they are over (their generations' aborts are sent by then)."""
    for task in tasks:
        task.cancel(why)
    await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: list[AsyncIterator], interval_s: float = 0.0,
                shown=lambda item: True) -> AsyncIterator[list[tuple[int, object]]]:
    """Items of several async iterators, tagged with the iterator's index, in batches: items go out at
    once until one is `shown` (something the client sees, e.g. non-empty text), then in batches of
    whatever arrived within interval_s of the last shown batch. Why: each batch becomes one SSE write,
    one trip through Serve's proxy, so a fast engine pays it per interval, not per round (Ray Serve
    LLM batches its streams the same way), while the first text is never held back."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put((i, item))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, err))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    loop, batches, last = asyncio.get_running_loop(), _Batches(queue, end, len(tasks)), float("-inf")
    try:
        while batches.open:
            batch = await batches.next(last + interval_s)
            if any(shown(item) for _, item in batch):
                last = loop.time()
            if batch:
                yield batch
    except Exception:  # a stream failed (raised by batches.next)
        await _cancel_all(tasks, SIBLING_FAILED)
        raise
    finally:
        await _cancel_all(tasks)


class _Batches:
    """merge()'s consumer side: batches of the queued (index, item) pairs; counts the open streams."""

    def __init__(self, queue: asyncio.Queue, end, streams: int):
        self.queue, self.end, self.open = queue, end, streams

    async def next(self, deadline: float) -> list:
        """The next item, then whatever is queued until `deadline` (or until every stream ended).
        A stream's exception is raised here."""
        loop, batch = asyncio.get_running_loop(), []
        item = await self.queue.get()
        while True:
            if item[1] is self.end:
                self.open -= 1
            elif isinstance(item[1], Exception):
                raise item[1]
            else:
                batch.append(item)
            left = deadline - loop.time()
            if not self.open or (left <= 0 and self.queue.empty()):
                return batch
            try:
                item = self.queue.get_nowait() if left <= 0 else await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                return batch
