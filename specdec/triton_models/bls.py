"""Decoupled BLS calls whose response iterators are let go of safely.

Why this exists (the stub crashes of rounds 2-5, root-caused in issue 43): the Python stub
inside nvidia-pytriton 0.7.0 is python_backend of late 2024 (it has `requested_output_names`
pruning, #366, and lacks the response iterator's `cancel()`, #398). In that stub:

  * a decoupled BLS call's ResponseIterator is owned twice: by Python, and by the stub's
    `response_iterator_map_`;
  * when the final response arrives, `ResponseIterator::Clear()` queues a cleanup for the stub's
    stub-to-parent thread, which erases the map entry there, without the GIL;
  * if Python has let go of the iterator first, that erase destroys it on that thread, and with
    it every response it kept (`responses_`): each response's tensors drop their numpy arrays,
    the bytes objects in them, and pymalloc blocks, without the GIL (`PbTensor::~PbTensor` takes
    the GIL only from #390, Dec 2024, which this stub predates).

Python's other threads allocate and free at the same moment, so the heap is corrupted now and
then: "free(): invalid pointer", "double free or corruption (fasttop)". Whether Python or the
erase lets go last is a race. The stub-to-parent thread also answers every `is_cancelled()`
(each a round trip to the server) and forwards every log line, so under load the erase often
comes last. tests/server/test_bls_release.py forces that order and shows the stub die.

So the iterator's last reference must be dropped by Python, after the erase. The
stub-to-parent queue is one FIFO thread, and a request's `is_cancelled()` that answers False
has been through it: a False answer is never cached, and it was queued after any cleanup
queued before the call. `RetiredIterators` keeps every finished iterator until such a fence
has returned, then drops it on the event loop's thread, which holds the GIL.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator, Awaitable, Callable

# One pool thread per live call blocks in the iterator's next(); a small default pool would
# queue every stream behind the slowest.
_NEXT_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="bls-next")


class RetiredIterators:
    """Finished response iterators held until a fence proves the stub has erased its own
    reference to them. One per stub process: the race is with that process's map."""

    def __init__(self) -> None:
        self._held: list = []

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, iterator) -> None:
        self._held.append(iterator)

    async def fence(self, is_cancelled: Callable[[], bool]) -> bool:
        """Ask whether a live request's client has gone (the answer is returned), and drop
        every iterator kept before the question if the answer proves a round trip: False is
        never cached, True may be, so a True answer keeps them for the next fence.

        is_cancelled must belong to a request whose final response has not been sent (the
        server may have released it after that), and nothing else may ask it at the same
        time (a concurrent call would share the other's answer)."""
        held, self._held = self._held, []
        released = False
        try:
            cancelled = await asyncio.get_running_loop().run_in_executor(_NEXT_THREADS, is_cancelled)
            released = not cancelled
            return cancelled
        finally:
            if released:
                held.clear()  # the last references, dropped here, on the event loop's thread
            else:
                self._held[:0] = held

    def drain(self, iterator, running: concurrent.futures.Future | None) -> None:
        """An iterator left before its final response (an error, a cancel): read it to its end
        on a pool thread (never two next() at once: the stub's Next() is not reentrant), then
        keep it. Dropping it unfinished would run that wait in its destructor, on whichever
        thread let go, the event loop's included."""
        loop = asyncio.get_running_loop()

        def read_to_end():
            if running is not None:
                try:
                    running.result()
                except Exception:  # noqa: BLE001 - an error response is an end too
                    pass
            try:
                while next(iterator, None) is not None:
                    pass
            except Exception:  # noqa: BLE001 - an error response ends it
                pass
            loop.call_soon_threadsafe(self.keep, iterator)

        _NEXT_THREADS.submit(read_to_end)


async def decoupled_responses(request, retired: RetiredIterators, poll_s: float,
                              while_waiting: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator:
    """The responses of a decoupled BLS call, each awaited off the event loop (the iterator
    blocks until the callee sends); while_waiting runs every poll_s meanwhile. On every way
    out the iterator goes to `retired`, never to the garbage collector."""
    iterator = iter(await request.async_exec(decoupled=True))
    running: concurrent.futures.Future | None = None
    finished = False
    try:
        while True:
            running = _NEXT_THREADS.submit(next, iterator, None)
            pending = asyncio.wrap_future(running)
            while while_waiting is not None and not pending.done():
                await asyncio.wait({pending}, timeout=poll_s)
                if not pending.done():
                    await while_waiting()
            response = await pending
            running = None
            if response is None:
                finished = True
                return
            yield response
    finally:
        if finished:
            retired.keep(iterator)
        else:
            retired.drain(iterator, running)
