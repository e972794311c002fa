"""Stopping a component's background tasks (watchers, sweepers, control loops) on close.

Called from the ``aclose()`` of every component that owns a background task: membership watchers
and agents, the cache storage sweeper, the ledger writer, the registry, the degradation ladder,
the autoscaler loop, the zone watch, the local actuator.

    await stop_tasks(self._task)              # None is fine: nothing was started
    await stop_tasks(*self._drains.values())

And running one that ticks at a fixed interval:

    self._task = asyncio.create_task(every(5.0, self.reap, "registry reaper", log))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable


async def stop_tasks(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel every task, then wait for each to finish its cleanup (its cancellation is swallowed,
    any other failure is not)."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def every(interval_s: float, tick: Callable[[], object], what: str, logger: logging.Logger) -> None:
    """Call `tick` every `interval_s` seconds (first after one interval), until cancelled: a tick that
    raises is logged ("<what> tick failed") and the next one still runs."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            tick()
        except Exception:  # one bad tick must not end the loop
            logger.exception("%s tick failed", what)
