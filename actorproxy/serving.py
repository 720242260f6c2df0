"""Serve inside the caller's Trio code: the ``async with`` block is the server's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio


@asynccontextmanager
async def served(serve: Callable[..., Awaitable[None]]) -> AsyncIterator[Any]:
    """Start ``serve(shutdown_trigger=..., task_status=...)``; yield what it reports started; stop it on exit.

    The exit triggers the server's own graceful shutdown and waits for it to return.
    """
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        running = await nursery.start(partial(serve, shutdown_trigger=stop.wait))
        try:
            yield running
        finally:
            stop.set()
