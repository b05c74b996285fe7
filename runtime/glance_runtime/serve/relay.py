"""Items from the decode thread to the event loop, with one loop wake-up per batch rather than per item.

A streamed answer emits a text piece per committed token. Waking the event loop for each one costs a
self-pipe write, a loop iteration and a GIL hand-over to the loop thread in the middle of the decode; here
the decode thread only appends, and schedules a wake-up when none is pending, so the pieces of one round
reach the loop (and the client, as one write) together.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque


class Relay:
    """put() from any thread; get() and batch() on the event loop the relay was made on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[object] = deque()
        self.lock = threading.Lock()
        self.woken = asyncio.Event()
        self.wake_pending = False

    def put(self, item: object) -> None:
        with self.lock:
            self.items.append(item)
            if self.wake_pending:
                return  # the wake-up already scheduled will find this item too
            self.wake_pending = True
        self.loop.call_soon_threadsafe(self.wake)

    def wake(self) -> None:
        with self.lock:
            self.wake_pending = False
        self.woken.set()

    async def wait(self) -> None:
        while True:
            with self.lock:
                if self.items:
                    return
                self.woken.clear()
            await self.woken.wait()

    async def get(self) -> object:
        """The next item."""
        await self.wait()
        with self.lock:
            return self.items.popleft()

    async def batch(self) -> list[object]:
        """Every item put so far (at least one), in order."""
        await self.wait()
        with self.lock:
            items = list(self.items)
            self.items.clear()
            return items
