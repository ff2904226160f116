"""Tokenization in threads, so the event loop keeps serving while a prompt is encoded
(`encode_batch_fast` releases the GIL; `encode` does not, so it would block the loop as
surely as running inline).

One pool per process, sized to the cores. When no other encoding is in flight (one
connection, a quiet moment), a prompt's pieces are spread over the pool, so a single
request uses every core; under load each request takes one thread and the cores are already
busy with other requests.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

WAYS = os.cpu_count() or 2
_pool: ThreadPoolExecutor | None = None
_in_flight = 0


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WAYS, "kvroute-tokenize")
    return _pool


def shares(items: Sequence[str], ways: int) -> list[list[str]]:
    """`items` in at most `ways` contiguous runs of about equal length in characters."""
    total = sum(map(len, items))
    runs: list[list[str]] = [[]]
    done = 0
    for item in items:
        if runs[-1] and len(runs) < ways and done + len(item) / 2 > total * len(runs) / ways:
            runs.append([])
        runs[-1].append(item)
        done += len(item)
    return runs


async def in_threads(
    fn: Callable[[list[str]], list[T]], items: list[str], *, spread: bool = True
) -> list[T]:
    """`fn(items)` in the pool; when nothing else is being encoded and `spread`, as several
    `fn(run)` over contiguous runs of `items` at once (the results concatenated)."""
    global _in_flight
    pool = _executor()
    loop = asyncio.get_running_loop()
    ways = WAYS if spread and _in_flight == 0 and len(items) > 1 else 1
    runs = shares(items, ways) if ways > 1 else [items]
    _in_flight += 1
    try:
        done = await asyncio.gather(*(loop.run_in_executor(pool, fn, run) for run in runs))
    finally:
        _in_flight -= 1
    return [x for part in done for x in part]
