"""merge(): deltas of several streams, batched by time so a fast engine pays one SSE write (one trip
through Serve's proxy) per interval, not per round; nothing lost, reordered or delayed at the start."""
import asyncio
import time

import pytest

from saguaro_dist.serve.api import ServerOptions
from saguaro_dist.serve.fan_in import merge


async def ticking(name: str, n: int, every_s: float, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"{name} failed")
        await asyncio.sleep(every_s)
        yield f"{name}{i}"


async def collect(streams, interval_s: float) -> tuple[list[list], float]:
    start, first_at, batches = time.monotonic(), None, []
    async for batch in merge(streams, interval_s):
        first_at = first_at if first_at is not None else time.monotonic() - start
        batches.append(batch)
    return batches, first_at


def test_interval_zero_passes_every_item_through_in_order():
    batches, _ = asyncio.run(collect([ticking("a", 5, 0.001), ticking("b", 3, 0.001)], 0.0))
    items = [item for batch in batches for item in batch]
    assert [x for i, x in items if i == 0] == [f"a{k}" for k in range(5)]
    assert [x for i, x in items if i == 1] == [f"b{k}" for k in range(3)]


def test_items_closer_than_the_interval_share_a_batch_and_the_first_is_not_held():
    batches, first_at = asyncio.run(collect([ticking("a", 20, 0.005)], 0.5))
    assert [x for batch in batches for _, x in batch] == [f"a{k}" for k in range(20)]
    assert len(batches) <= 3, [len(b) for b in batches]  # ~100 ms of items (more on a loaded box) in 500 ms windows
    assert len(batches[0]) == 1 and first_at < 0.4  # the first token goes out at once, not after the window


def test_a_failing_stream_raises_through_the_batches():
    with pytest.raises(RuntimeError, match="b failed"):
        asyncio.run(collect([ticking("a", 50, 0.001), ticking("b", 5, 0.001, fail_at=2)], 0.01))


def test_stream_interval_is_validated():
    with pytest.raises(ValueError, match="stream_interval_ms"):
        ServerOptions(served_model_name="m", stream_interval_ms=-1)


@pytest.mark.parametrize("value, want", [(None, 50.0), ("0", 0.0), ("50", 50.0), (20, 20.0)])
def test_stream_interval_from_app_args(value, want):
    from saguaro_dist.serve.app import server_options
    args = {} if value is None else {"stream_interval_ms": value}
    assert server_options(args, "m").stream_interval_ms == want


@pytest.mark.parametrize("value", ["soon", -5])
def test_a_bad_stream_interval_fails_at_deploy_time(value):
    from saguaro_dist.serve.app import build_app
    with pytest.raises(ValueError, match="stream_interval_ms"):
        build_app({"model": "m", "draft": "d", "stream_interval_ms": value})


async def silent_first(n: int, every_s: float):
    yield ""  # e.g. a first delta whose text the detokenizer holds back
    async for item in ticking("a", n, every_s):
        yield item


def test_batching_starts_after_the_first_shown_item():
    async def first_shown_after() -> float:
        start = time.monotonic()
        async for batch in merge([silent_first(3, 0.01)], 1.0, shown=bool):
            if any(x for _, x in batch):
                return time.monotonic() - start
    assert asyncio.run(first_shown_after()) < 0.6  # not held for the 1 s interval (wide margins: CI boxes run loaded)
