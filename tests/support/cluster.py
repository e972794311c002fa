"""A whole Switchboard cluster of real processes on loopback, for integration tests.

    with Cluster(shards=2, caches=2, engine="synthetic") as c:
        openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=c.keys["plus"])

Shards with the synthetic engine start in about a second (no model); `engine="torch"`
loads the real model in each shard.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx

from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import scrape
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, Service, free_port, stop_all

KEYS = {
    "free": "sk-test-free-0123456789",
    "plus": "sk-test-plus-0123456789",
    "enterprise": "sk-test-ent-0123456789",
    "plus2": "sk-test-plus2-0123456789",
}
ADMIN_TOKEN = "test-admin-token"


def api_keys_env() -> str:
    return ",".join([f"{KEYS['free']}:acme:free", f"{KEYS['plus']}:acme:plus",
                     f"{KEYS['enterprise']}:bigco:enterprise", f"{KEYS['plus2']}:acme:plus"])


class Cluster:
    def __init__(self, *, shards: int = 2, caches: int = 2, engine: str = "synthetic",
                 shard_args: list[str] | None = None, gateway_args: list[str] | None = None,
                 token_delay_ms: float = 2.0) -> None:
        self.control_plane = Service(["control-plane", "--admin-token", ADMIN_TOKEN])
        registry = self.control_plane.url
        self.registry = registry
        self.caches = [Service(["cache-node", "--registry-url", registry, "--node-id", f"cache-{i}"])
                       for i in range(caches)]
        extra = list(shard_args or [])
        if engine == "synthetic":
            extra += ["--synthetic-token-delay-ms", str(token_delay_ms)]
        self.shards = [Service(["shard", "--engine", engine, "--registry-url", registry, "--node-id", f"shard-{i}",
                                *extra], ready_timeout=180) for i in range(shards)]
        gw = ["gateway", "--registry-url", registry, *(gateway_args or [])]
        if engine == "synthetic":
            gw += ["--tokenizer", "whitespace", "--model-name", "synthetic"]
        self.gateway = Service(gw, env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        self.keys = KEYS

    def start(self) -> Self:
        try:
            self.control_plane.start()
            for s in self.caches + self.shards:
                s.start(wait=False)
            for s in self.caches + self.shards:
                s.wait_healthy()
            self.gateway.start()
            self.wait_members(len(self.shards), len(self.caches))
        except BaseException:
            self.stop()
            raise
        return self

    def wait_members(self, shards: int, caches: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = scrape(self.gateway.url)
            seen = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("switchboard_gateway_members{")}
            if seen.get("shard") == shards and seen.get("cache") == caches:
                return
            time.sleep(0.1)
        raise AssertionError(f"gateway did not see {shards} shards / {caches} caches: {seen}")

    def stop(self) -> None:
        # The members together, then the registry they deregister from (it outlives them, as before).
        stop_all([self.gateway, *self.shards, *self.caches])
        self.control_plane.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


FP32_SHARD = (*INVARIANT_ARGS, "--threads", "1")
"""A real-model shard's flags where greedy output must not depend on batching: the batch-invariant format
(tests/support/formats.py), one thread."""


@contextmanager
def static_shards(*each: Sequence[str], gateway_args: Sequence[str] = (),
                  ready_timeout: float = 180) -> Iterator[tuple[list[Service], Service]]:
    """One real shard per flag list in `each`, started at once, and a gateway routing to them by
    ``--shard-urls`` (no registry; its one cache URL answers nothing):
    ``with static_shards(FP32_SHARD, FP32_SHARD) as (shards, gw): ...``. Every process is stopped on
    exit; a test may kill a shard first."""
    shards = [Service(["shard", *args], ready_timeout=ready_timeout) for args in each]
    for s in shards:
        s.start(wait=False)
    try:
        for s in shards:
            s.wait_healthy()
        with Service(["gateway", "--shard-urls", ",".join(s.url for s in shards), "--cache-urls",
                      "http://127.0.0.1:1", *gateway_args], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()}) as gw:
            yield shards, gw
    finally:
        for s in shards:
            s.stop()


def open_control_plane(*args: str, log_path: Path | None = None, port: int | None = None) -> Service:
    """`switchboard control-plane --admin-token ADMIN_TOKEN ARGS` without a cluster token (the
    registry's open mode) and without the pytest process's SWITCHBOARD_* variables; not started.
    Restart one on the same port with `port=old.port`."""
    return Service(["control-plane", "--admin-token", ADMIN_TOKEN, *args], port=port, ready_timeout=20.0,
                   isolated=True, log_path=log_path)


def cache_node(*args: str, log_dir: Path | None = None, port: int | None = None) -> Service:
    """`switchboard cache-node ARGS` without a cluster token (its sessions routes open), not started."""
    port = port or free_port()
    log_path = log_dir / f"cache-node-{port}.log" if log_dir is not None else None
    return Service(["cache-node", *args], port=port, ready_timeout=20.0, isolated=True, log_path=log_path,
                   env={"PYTHONUNBUFFERED": "1"})


@contextmanager
def gateway_before(shard: Service, state: Path, keys: str | None = None, args: Sequence[str] = ()) -> Iterator[Service]:
    """A started gateway in front of `shard` alone, with a cache node of its own (its state in `state`; the
    `plus` key unless `keys`, as SWITCHBOARD_GATEWAY_API_KEYS reads them; `args`: more gateway flags). For
    tests of the API, not of failover: a 60 s silence timeout, and start-up allowed minutes on a loaded host."""
    cache = cache_node().start()
    gw = Service(["gateway", "--shard-urls", shard.url, "--cache-urls", cache.url, "--state-dir", str(state),
                  "--usage-db", "off", "--silence-timeout-s", "60", *args],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": keys or f"{KEYS['plus']}:acme:plus"}, ready_timeout=240)
    try:
        with gw:
            yield gw
    finally:
        cache.stop()


def start_cache_nodes(count: int, *args: str, log_dir: Path | None = None) -> list[Service]:
    """`count` :func:`cache_node`s started at once (start-up overlaps), all healthy (or all stopped)."""
    nodes = [cache_node(*args, log_dir=log_dir) for _ in range(count)]
    try:
        for n in nodes:
            n.start(wait=False)
        for n in nodes:
            n.wait_healthy()
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def unique_id(prefix: str = "shard") -> str:
    """A member id no other test uses (`shard-test-1a2b3c4d`)."""
    return f"{prefix}-test-{uuid.uuid4().hex[:8]}"


def stored_session(cache_url: str, session_id: str) -> dict | None:
    """What a cache node holds for a session, its transcript opened as the cluster's gateways open
    it (their key is derived from the cluster token); None when the node lacks it."""
    from data_plane.common.crypto import Keyring, TranscriptSealer

    r = httpx.get(f"{cache_url}/v1/sessions/{session_id}", headers=CLUSTER_HEADERS)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    record = r.json()
    sealer = TranscriptSealer(Keyring.derived(CLUSTER_TOKEN))
    return {**record, "messages": sealer.open(session_id, record["owner"], record["messages"])}


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


LIFTED_TIERS = """
tiers:
  free:       {priority: 2, rpm: 1000000, tpm: 100000000, max_context_tokens: 2048,
               max_output_tokens: 256, replication: 1, shed_order: 0}
  plus:       {priority: 1, rpm: 1000000, tpm: 100000000, max_context_tokens: 2048,
               max_output_tokens: 256, replication: 1, shed_order: 1}
  enterprise: {priority: 0, rpm: 1000000, tpm: 100000000, max_context_tokens: 2048,
               max_output_tokens: 256, replication: 1, shed_order: 2}
"""
"""The default tiers with rate limits out of the way, for tests of admission and overload (a 429 is not
what they test): tiers-file contents."""
