"""The pipeline group's rendezvous store, bound to the cluster token: torch's TCPStore, every value sealed.

    store = GroupStore.serve("10.0.0.1", 29500, world=2, token=tok)        # stage 0
    store.set("spec/1", json.dumps(args))
    store = GroupStore.connect("10.0.0.1", 29500, token=tok)               # a stage: StoreRefused on a wrong token
    args = json.loads(store.get("spec/1"))
    store.beat(1, n); store.beat_count(1)                                   # heartbeats (pipeline_net.heartbeat)

Why: stage 0's TCPStore is how the stages of a group find each other (each stage's arguments, its link
address, its load report, its heartbeat), and torch's TCPStore takes no credential: any process that
reached the port could read every key (it even lists them: ``list_keys``), learn the model and the
group's layout, rewrite a stage's link address, report false load figures, or keep a dead stage's
heartbeat counter moving so stage 0 never notices it is gone. A secret key prefix would not help, since
the store lists its keys. So every value is sealed (AES-256-GCM) with a key derived (HKDF-SHA256) from
the cluster token and a random nonce stage 0 publishes in the clear under ``group`` when it starts; the
associated data is the key's name, so a value moved to another key does not open. Heartbeats are
sealed counters that must grow: an old beat replayed does not count as a new one.

What it closes: a process without the token (wrong, missing) learns nothing from the store but the
group nonce and the key names, cannot publish anything a stage accepts, and cannot fake a heartbeat. A
stage started with the wrong token finds out on its first read, before it loads a layer, and exits
with one line (``StoreRefused``), having written nothing: the group goes on waiting for the real one.
Together with the links' own handshake (pipeline_links.py: each connection proves the token both ways)
no process without the token takes part in a group.

What remains: denial of service by anyone who reaches the port (overwrite or delete a key, flood the
store: a value that does not open fails the group's start, it is never used); and everything on the
path, since neither the store's connection nor a link is encrypted beyond these values (hidden states
cross the wire in the clear after the links' handshake). Run a group's stages on a private network
(docs/SHARDING.md). Without a token (one machine, no ``SWITCHBOARD_CLUSTER_TOKEN``) the seal's key is
derived from the empty string: values still cannot be moved between keys, nothing is secret; stage 0
refuses stages from other hosts then (pipeline.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

GROUP_KEY = "group"
"""Where stage 0 publishes the group's nonce, in the clear (the HKDF salt: a new key per group)."""
KEY_INFO = b"switchboard pipeline store v1"
NONCE_BYTES = 12
GROUP_NONCE_BYTES = 16


class StoreRefused(Exception):
    """A value of the group's store did not open: this process's cluster token is not the group's, or the
    value was tampered with. The message is one line for an operator."""


def group_key(token: str | None, group_nonce: bytes) -> bytes:
    """The seal's key: HKDF-SHA256 over the cluster token, salted with the group's nonce."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=group_nonce, info=KEY_INFO).derive((token or "").encode())


class GroupStore:
    """A TCPStore whose values are sealed with the group's key (see the module's docstring)."""

    def __init__(self, store: Any, key: bytes, where: str) -> None:
        self.store = store
        self._aead = AESGCM(key)
        self._key = key
        self.where = where
        self._beats: dict[int, int] = {}

    @classmethod
    def serve(cls, host: str, port: int, world: int, token: str | None, timeout_s: float) -> GroupStore:
        """Stage 0: the store's server, and a fresh group nonce published in it."""
        import torch.distributed as dist

        # torch's server listens on every interface whatever `host` says (on `*`: a pipeline shard on
        # 127.0.0.1 had its store reachable from the network, for anyone to delete or overwrite keys, a
        # stage's heartbeat among them): it is handed a socket bound to `host` alone, which it then owns
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=listener.detach())
        nonce = os.urandom(GROUP_NONCE_BYTES)
        store.set(GROUP_KEY, nonce.hex())
        return cls(store, group_key(token, nonce), f"{host}:{port}")

    @classmethod
    def connect(cls, host: str, port: int, token: str | None, timeout_s: float) -> GroupStore:
        """A stage: a client of stage 0's store (waits up to `timeout_s` for it and its nonce)."""
        import torch.distributed as dist

        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
        try:
            nonce = bytes.fromhex(store.get(GROUP_KEY).decode())
        except ValueError:
            raise StoreRefused(f"the pipeline group's store at {host}:{port} holds no valid group nonce "
                               "(not a Switchboard group, or tampered with)") from None
        return cls(store, group_key(token, nonce), f"{host}:{port}")

    def another(self, timeout_s: float) -> GroupStore:
        """A second connection with the same key (one per thread: a TCPStore client is not shared)."""
        import torch.distributed as dist

        host, _, port = self.where.rpartition(":")
        return GroupStore(dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=timeout_s)),
                          self._key, self.where)

    def set(self, name: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        nonce = os.urandom(NONCE_BYTES)
        self.store.set(name, nonce + self._aead.encrypt(nonce, data, name.encode()))

    def get(self, name: str) -> bytes:
        """The value under `name` (waits for it as the TCPStore does); StoreRefused if it does not open."""
        raw = bytes(self.store.get(name))
        try:
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], name.encode())
        except (InvalidTag, ValueError):
            raise StoreRefused(
                f"{name!r} in the pipeline group's store at {self.where} does not open with this process's cluster "
                "token: SWITCHBOARD_CLUSTER_TOKEN differs from stage 0's (or the store was tampered with)") from None

    def beat(self, rank: int, count: int) -> None:
        """A stage's heartbeat: its own counter, sealed."""
        self.set(f"hb/{rank}", str(count))

    def beat_count(self, rank: int) -> int:
        """The highest heartbeat counter of `rank` seen so far (-1: none yet). A value that does not open,
        or one not above the last (a replay), leaves it where it was: the beat does not count."""
        last = self._beats.get(rank, -1)
        if not self.store.check([f"hb/{rank}"]):
            return last
        try:
            count = int(self.get(f"hb/{rank}"))
        except (StoreRefused, ValueError):
            return last
        if count > last:
            self._beats[rank] = count
        return self._beats.get(rank, last)


__all__ = ["GROUP_KEY", "GroupStore", "StoreRefused", "group_key"]
