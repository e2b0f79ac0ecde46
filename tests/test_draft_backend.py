"""LocalDraftBackend: every call in order, one at a time; a call the caller waits for runs on the
caller's thread when nothing is queued (waking the idle worker thread costs ~1 ms on a VM)."""
import threading
import time

from saguaro_dist.config import Config
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend


def backend() -> LocalDraftBackend:
    _, draft = demo_pair()
    return LocalDraftBackend(build_draft_worker(Config(model=draft, draft=draft, mode="ssd", k=2)))


def test_a_waited_call_runs_on_the_callers_thread_when_nothing_is_queued():
    b = backend()
    try:
        assert b.call(lambda _: threading.current_thread(), None) is threading.current_thread()
    finally:
        b.close()


def test_a_waited_call_behind_queued_work_runs_after_it_in_order():
    b = backend()
    seen, release = [], threading.Event()
    try:
        b.submit(lambda _: (release.wait(5), seen.append("queued")), None)
        b.submit(lambda _: seen.append("second"), None)
        threading.Timer(0.05, release.set).start()
        thread = b.call(lambda _: (seen.append("waited"), threading.current_thread())[1], None)
        assert seen == ["queued", "second", "waited"] and thread is not threading.current_thread()
    finally:
        b.close()


def test_a_call_submitted_during_an_inline_call_waits_for_it():
    b = backend()
    seen = []
    try:
        def inline(_):
            b.submit(lambda _: seen.append("submitted"), None)
            time.sleep(0.05)  # the worker thread is free now: only the running lock holds it back
            seen.append("inline")
        b.call(inline, None)
        b.call(lambda _: None, None)  # queued behind the submitted call, so it waits for it
        assert seen == ["inline", "submitted"]
    finally:
        b.close()
