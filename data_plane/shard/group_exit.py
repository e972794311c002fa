"""How a shard leaves when its engine can no longer serve (a lost pipeline stage, a dead scheduler thread).

    exit = GroupExit.attach(engine, asyncio.get_running_loop(), lambda: agent.aclose() if agent else None)
    # engine.on_dead is now exit.trigger: any thread (the pipeline's monitor) calls it
    ...                                    # at the end of the lifespan's shutdown:
    exit.finish()                          # exits with status 1 if it was triggered

The engine has already failed every open stream with an error event (the gateway resumes each on
another shard: data_plane/routing/resume.py). `trigger` then deregisters at once, not a TTL
later, lingers `linger_s` (the shard's --pipeline-exit-linger-s: /metrics still answers, so a
scrape sees `switchboard_shard_pipeline_stage_up` 0 and the stage-gone alert fires), and sends the process SIGTERM: uvicorn's graceful shutdown runs the lifespan's cleanup, whose
last step, `finish`, exits with status 1 so the supervisor or the actuator replaces the whole group
(data_plane/shard/engines/pipeline.py). A shutdown that hangs still ends after HARD_EXIT_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

HARD_EXIT_S = 10.0


class GroupExit:
    def __init__(self, loop: asyncio.AbstractEventLoop, deregister: Callable[[], Awaitable[None] | None],
                 linger_s: float = 0.0) -> None:
        self.loop = loop
        self.deregister = deregister
        self.linger_s = linger_s
        self.exit_code = 0
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def attach(cls, engine: object, loop: asyncio.AbstractEventLoop,
               deregister: Callable[[], Awaitable[None] | None], linger_s: float = 0.0) -> GroupExit:
        """A GroupExit the engine triggers when it dies for good (engines with an `on_dead` hook)."""
        group_exit = cls(loop, deregister, linger_s)
        if hasattr(engine, "on_dead"):
            engine.on_dead = group_exit.trigger
        return group_exit

    def trigger(self) -> None:
        """Leave membership and exit (any thread; once)."""
        if not self.exit_code:
            self.exit_code = 1
            self.loop.call_soon_threadsafe(lambda: self._tasks.append(self.loop.create_task(self._leave(),
                                                                                           name="shard-leave")))

    async def _leave(self) -> None:
        log.error("the engine can no longer serve: leaving membership and exiting")
        threading.Timer(HARD_EXIT_S + self.linger_s, os._exit, (1,)).start()
        pending = self.deregister()
        if pending is not None:
            await pending
        await asyncio.sleep(self.linger_s)
        os.kill(os.getpid(), signal.SIGTERM)

    def finish(self) -> None:
        """The last step of the shutdown: exit non-zero when triggered."""
        if self.exit_code:
            logging.shutdown()
            os._exit(self.exit_code)
