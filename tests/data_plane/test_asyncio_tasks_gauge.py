"""``switchboard_<process>_asyncio_tasks`` (data_plane/common/slow_clients.py): the event loop's tasks not done
at the scrape, on every server's /metrics, so a task started per request and never ended shows as growth
(the soak bounds it per process: tests/reliability/test_soak.py)."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, generate_latest

from data_plane.common.slow_clients import SlowClientMetrics, running_tasks
from tests.support.metrics import samples


def _scraped(registry: CollectorRegistry) -> float:
    return sum(v for _, v in samples(generate_latest(registry).decode(), "switchboard_gateway_asyncio_tasks"))


def test_the_gauge_counts_the_tasks_not_done_at_each_scrape() -> None:
    registry = CollectorRegistry()
    SlowClientMetrics(registry, "gateway")

    async def go() -> None:
        idle = _scraped(registry)  # this coroutine's own task
        held = [asyncio.create_task(asyncio.sleep(60)) for _ in range(25)]
        await asyncio.sleep(0)
        assert _scraped(registry) == idle + 25
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert _scraped(registry) == idle  # ended tasks are not counted

    asyncio.run(go())
    assert math.isnan(running_tasks())  # off the event loop's thread: not a number, not an error
