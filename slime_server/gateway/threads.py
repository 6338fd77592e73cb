"""``in_thread``: run a blocking call (a store commit, a template render) off the event loop.

Why anyio's thread pool and not ``asyncio.to_thread``: it is the pool FastAPI runs sync endpoints on,
with its limit (40 threads), so the core's blocking calls and the app's queue in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import anyio.to_thread

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))
