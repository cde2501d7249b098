"""pending.LoopPost: the engine thread's outputs reach the request's event loop in order, those posted before the loop
runs in one wake-up rather than one each."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpt2x.serve.openai.pending import LoopPost


def test_calls_posted_from_another_thread_run_in_order_on_one_wake_up():
    loop = asyncio.new_event_loop()
    try:
        woken = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: woken.append(a) or real(*a)
        post = LoopPost.of(loop)
        assert LoopPost.of(loop) is post  # one per loop
        got: list[int] = []
        poster = threading.Thread(target=lambda: [post(got.append, i) for i in range(200)])
        poster.start()
        poster.join()
        assert got == []  # nothing runs off the loop
        loop.run_until_complete(asyncio.sleep(0))
        assert got == list(range(200)) and len(woken) == 1
        post(got.append, 200)  # after a wake-up has run, the next call wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert got[-1] == 200 and len(woken) == 2
    finally:
        loop.close()


def test_a_closed_loop_is_said_to_the_caller_each_time():
    loop = asyncio.new_event_loop()
    post = LoopPost.of(loop)
    loop.close()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            post(print, "never")
