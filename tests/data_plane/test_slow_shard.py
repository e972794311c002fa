"""A shard that answers, but slowly (SIGSTOPped most of every cycle, as a throttled or swapping host):
with real processes, new sessionless requests and the sessions it held go to the fast shard, and come
back once it is fast again (data_plane/routing/latency.py). It fails nothing, so ejection never saw it.

    .venv/bin/python -m pytest tests/data_plane/test_slow_shard.py -q       # ~30-60 s
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai

from tests.support.cluster import KEYS, Cluster
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually

GATEWAY_ARGS = ["--latency-spill-factor", "3", "--latency-spill-floor-s", "0.3", "--silence-timeout-s", "10", "--routing-policy", "affinity"]
"""A lower floor than the default 1 s, so a stop of 0.7 s per cycle makes a clear outlier; silence well above the stop, so the stopped shard is slow, never failed (no ejection
is involved). Affinity: a session returns to its ring shard once that is fast (under kv_aware it stays
where its KV now is, unless that shard is loaded: tests/data_plane/test_router_latency.py)."""

SHARD_ARGS = ["--registration-ttl-s", "3"]
"""Well above the stop: the default 0.8 s TTL with a heartbeat every TTL/3 lapsed in a 0.7 s stop (a beat
due just after the stop came up to ~0.97 s after the last), so the slow shard flapped out of membership: its
gauge went (read as 0) and its samples were dropped meanwhile; the test measured flapping, not slowness."""


@contextmanager
def throttled(shard: Service, stop_s: float = 0.7, run_s: float = 0.3) -> Iterator[None]:
    """`shard` stopped `stop_s` out of every `stop_s + run_s` seconds until the block ends."""
    assert shard.proc is not None
    proc, done = shard.proc, threading.Event()

    def cycle() -> None:
        while not done.is_set():
            proc.send_signal(signal.SIGSTOP)
            done.wait(stop_s)
            proc.send_signal(signal.SIGCONT)
            done.wait(run_s)

    t = threading.Thread(target=cycle, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=5)
        proc.send_signal(signal.SIGCONT)


def served(shard: Service) -> float:
    return metric(shard.url, "vllm:request_success_total")


def chat(sdk: openai.OpenAI, session: str | None) -> None:
    headers = {"X-Session-Id": session} if session else {}
    sdk.chat.completions.create(model="synthetic", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                extra_headers=headers)


def new_session(c: Cluster, sdk: openai.OpenAI) -> tuple[str, int]:
    """A new session and the shard index its first turn went to."""
    before = [served(s) for s in c.shards]
    raw = sdk.chat.completions.with_raw_response.create(
        model="synthetic", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Session-Id": "new"})
    after = [served(s) for s in c.shards]
    return raw.headers["x-session-id"], [b > a for a, b in zip(before, after, strict=True)].index(True)


def where(c: Cluster, sdk: openai.OpenAI, session: str | None) -> int:
    """The index of the shard that served one request (the shards' own counts, read around it)."""
    before = [served(s) for s in c.shards]
    chat(sdk, session)
    after = [served(s) for s in c.shards]
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
    assert len(moved) == 1, (before, after)
    return moved[0]


def test_a_slow_shard_loses_new_requests_and_its_sessions_and_gets_them_back_once_fast() -> None:
    with Cluster(shards=2, caches=1, token_delay_ms=1, gateway_args=GATEWAY_ARGS, shard_args=SHARD_ARGS) as c:
        sdk = openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=KEYS["enterprise"], max_retries=0, timeout=60)
        on_slow = [s for s, i in (new_session(c, sdk) for _ in range(16)) if i == 1][:3]
        assert on_slow, "no session placed on shard-1"
        for _ in range(10):  # both measured while fast
            chat(sdk, None)
        url = c.gateway.url
        with throttled(c.shards[1]):
            def spilled() -> bool:
                for s in on_slow:
                    chat(sdk, s)
                chat(sdk, None)
                return metric(url, "switchboard_router_latency_spills_total", reason="outlier") >= 1
            eventually(spilled, 90, interval_s=0.0, what="a session sent away from the slow shard",
                       detail=lambda: c.gateway.log_tail(3000))
            assert metric(url, "switchboard_router_shard_latency_seconds", shard="shard-1") > 0.3
            # now the fast shard takes the slow one's sessions and nearly all new requests (the slow one
            # is tried again when its estimate has decayed: at most a probe or two in this window)
            picks = [where(c, sdk, s) for s in on_slow for _ in range(3)] + [where(c, sdk, None) for _ in range(10)]
            assert picks.count(1) <= 2, (picks, [metric(url, "switchboard_router_shard_latency_seconds", shard=f"shard-{i}")
                                                 for i in range(2)], c.gateway.log_tail(2000))
        assert metric(url, "switchboard_router_ejections_total") == 0  # slow, never failed
        # slow, never out of membership: a flap drops its gauge (read as 0 above) and its samples meanwhile
        assert "routing view: 1 shards" not in c.gateway.log_tail(10**7), c.gateway.log_tail(3000)
        # fast again: its sessions and a share of new requests come back once its estimate decays and a
        # fast answer is measured (seconds: the decay is 10 s)
        eventually(lambda: all(where(c, sdk, s) == 1 for s in on_slow), 90, interval_s=0.2,
                   what="the sessions back on shard-1", detail=lambda: c.gateway.log_tail(3000))
        eventually(lambda: where(c, sdk, None) == 1, 60, interval_s=0.2, what="new requests on shard-1 again")  # not a flood: the abuse monitor limits a key to 6 RPM after one
