"""Running user calls with a deadline each and bounded concurrency.

Sync calls each run in their own daemon thread, at most `max_concurrency` at a time. A call
past its deadline is reported as timed out and *abandoned*: Python cannot kill a thread, so
the thread keeps running until the function returns, but nobody waits for it and its result
is dropped. The threads are daemon threads on purpose: `concurrent.futures` pools join their
threads at interpreter exit, so one hung reward function would keep the process from ever
exiting; a thread of our own also frees its concurrency slot the moment it is abandoned.

Async calls run as tasks on one event loop per batch, itself in a daemon thread, each under
`asyncio.wait_for`. A coroutine that blocks (`time.sleep` inside `async def`) stalls the whole
loop, where `wait_for` cannot fire; the caller then times it out itself, a little after its
deadline, and gives up on the calls that could not start.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


@dataclass
class Outcome:
    """What one call produced: a value, an exception, or a timeout."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    blocked_by: int | None = None  # async: the call that blocked the event loop (maybe this one)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def run_sync(calls: list[Callable[[], Any]], timeout_s: float, max_concurrency: int,
             stop_on_error: bool) -> list[Outcome | None]:
    """Run `calls`, each in a daemon thread with its own deadline of `timeout_s`.

    Returns one Outcome per call, in order. With `stop_on_error`, the first failure stops the
    run: calls not yet started are skipped (None) and running ones are abandoned.
    """
    outcomes: list[Outcome | None] = [None] * len(calls)
    finished: queue.SimpleQueue = queue.SimpleQueue()  # (index, Outcome) posted by the threads
    todo, deadlines = deque(range(len(calls))), {}  # deadlines: index -> monotonic deadline of a running call
    failed = False

    def target(i: int) -> None:
        try:
            finished.put((i, Outcome(value=calls[i]())))
        except BaseException as exc:  # reported to the caller, never swallowed
            finished.put((i, Outcome(error=exc)))

    while todo or deadlines:
        while todo and len(deadlines) < max_concurrency:
            i = todo.popleft()
            deadlines[i] = time.monotonic() + timeout_s
            threading.Thread(target=target, args=(i,), daemon=True, name=f"reward-call-{i}").start()
        try:
            i, outcome = finished.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
            if deadlines.pop(i, None) is not None:  # else: a call already reported as timed out
                outcomes[i] = outcome
                failed = failed or not outcome.ok
        except queue.Empty:
            now = time.monotonic()
            for j in [j for j, d in deadlines.items() if d <= now]:
                del deadlines[j]
                outcomes[j], failed = Outcome(timed_out=True), True
        if stop_on_error and failed:
            break
    return outcomes


def run_async(calls: list[Callable[[], Awaitable[Any]]], timeout_s: float, max_concurrency: int,
              stop_on_error: bool) -> list[Outcome | None]:
    """Run coroutine factories `calls` on one event loop, each under `wait_for(timeout_s)`.

    Same contract as `run_sync`. When the loop is blocked, the call blocking it times out
    and every call still pending times out with `blocked_by` naming it.
    """
    outcomes: list[Outcome | None] = [None] * len(calls)
    events: queue.SimpleQueue = queue.SimpleQueue()  # ("start" | "done" | "exit", index, Outcome | None)
    running: list[int | None] = [None]  # the call whose code the loop is executing right now
    loop = asyncio.new_event_loop()
    # Grace past a deadline before the caller looks for a blocked loop: wait_for normally
    # reports the timeout on time, but the machine may be busy.
    grace_s = 0.2 * timeout_s + 0.2

    async def one(i: int, slots: asyncio.Semaphore) -> None:
        async with slots:
            events.put(("start", i, None))
            try:
                outcome = Outcome(value=await asyncio.wait_for(_Tracked(calls[i](), i, running), timeout_s))
            except asyncio.TimeoutError:
                outcome = Outcome(timed_out=True)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                outcome = Outcome(error=exc)
            events.put(("done", i, outcome))

    async def main() -> None:
        slots = asyncio.Semaphore(max_concurrency)
        await asyncio.gather(*(one(i, slots) for i in range(len(calls))), return_exceptions=True)

    task_box: list[asyncio.Task] = []

    def serve() -> None:
        try:
            task_box.append(loop.create_task(main()))
            loop.run_until_complete(task_box[0])
        except BaseException:
            pass  # cancelled by the caller after it stopped waiting
        finally:
            loop.close()
            events.put(("exit", -1, None))

    threading.Thread(target=serve, daemon=True, name="reward-async-loop").start()
    deadlines: dict[int, float] = {}
    pending = set(range(len(calls)))
    while pending:
        wait_s = max(0.0, min(deadlines.values()) + grace_s - time.monotonic()) if deadlines else None
        try:
            kind, i, outcome = events.get(timeout=wait_s)
        except queue.Empty:
            blocker = running[0]
            if blocker is not None:  # the loop is stuck inside one call: nothing else can finish
                for j in pending:
                    outcomes[j] = Outcome(timed_out=True, blocked_by=blocker)
                break
            now = time.monotonic()  # not blocked, only late: time out the overdue calls
            for j in [j for j, d in deadlines.items() if d + grace_s <= now]:
                del deadlines[j]
                pending.discard(j)
                outcomes[j] = Outcome(timed_out=True)
            if stop_on_error:
                break
            continue
        if kind == "exit":  # the loop ended with calls unreported: it failed itself
            for j in pending:
                outcomes[j] = Outcome(error=RuntimeError("the event loop stopped before this call finished"))
            break
        if kind == "start":
            deadlines[i] = time.monotonic() + timeout_s
            continue
        if i not in pending:
            continue  # already reported as timed out
        deadlines.pop(i, None)
        pending.discard(i)
        outcomes[i] = outcome
        if stop_on_error and not outcome.ok:
            break
    _cancel(loop, task_box)
    return outcomes


class _Tracked:
    """Awaitable proxy for a coroutine that records, while the coroutine's own code runs,
    which call it is; so a call that blocks the loop can be named from another thread."""

    def __init__(self, coro: Any, index: int, running: list) -> None:
        self.coro, self.index, self.running = coro, index, running

    def __await__(self):
        send, error = None, None
        while True:
            self.running[0] = self.index
            try:
                yielded = self.coro.throw(error) if error is not None else self.coro.send(send)
            except StopIteration as stop:
                return stop.value
            finally:
                self.running[0] = None
            try:
                send, error = (yield yielded), None
            except BaseException as exc:  # cancellation and wake-up errors go into the coroutine
                send, error = None, exc


def _cancel(loop: asyncio.AbstractEventLoop, task_box: list) -> None:
    """Cancel what is left on the loop (after an early stop); harmless once it has finished."""
    try:
        if task_box and not loop.is_closed():
            loop.call_soon_threadsafe(task_box[0].cancel)
    except RuntimeError:
        pass  # the loop closed in between
