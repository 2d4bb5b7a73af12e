"""Event-loop helpers for tests: no timing involved."""

from __future__ import annotations

import asyncio


async def one_loop_iteration() -> None:
    """Let every ready task run once (a future resolved by the loop itself; no timing involved)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut
