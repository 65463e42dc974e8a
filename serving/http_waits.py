"""Waiting inside an HTTP handler on work that a client going away makes pointless.

1. `unless_gone(request, work)` runs `work` until it ends or the client disconnects, whichever
   comes first: the finished task (its result or its exception inside), or None when the client
   left first (then `work` was cancelled and waited for; a handler cancelled meanwhile cancels
   it too).
2. `until_disconnected(request)` returns when the client has gone (its body is read already).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


async def unless_gone(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """Step 1 of the module docstring."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task


async def until_disconnected(request: Request) -> None:
    """Step 2 of the module docstring."""
    message: dict[str, Any] = {}
    while message.get("type") != "http.disconnect":
        message = await request.receive()
