"""The abuse monitor's state at rest: sealed in the control plane's state dir, so flags, actions,
bans, lifts and the recent history survive a restart and are in force again at once.

    store = open_state_file(settings.state_dir, keys_file=settings.state_keys_file, cluster_token=tok,
                            registry=registry)                      # None without --state-dir
    state = store.load()                                            # None: nothing saved (or unreadable)
    store.save(state)                                               # after every change, atomically

The file (``abuse.json`` in ``--state-dir``) is ``{"version": 1, "sealed": "sb1.<key id>.<nonce>.<ct>"}``:
AES-256-GCM over the JSON of the monitor's state (control_plane/abuse/monitor.py snapshot), with its
own associated data so no other sealed record opens as this one. It holds key ids (digests), tenant
names, addresses and reasons (numbers): never a prompt, which the monitor never sees. The key: the
first line of ``--state-keys-file`` (the session keys file's format; every listed key opens), else
one derived from the cluster token with its own HKDF label; with neither, nothing is written (a
per-process key would seal a file no later process could open) and a warning says so. A file that
cannot be opened (tampered, or sealed with a key no longer listed) is moved aside to ``*.corrupt``
and logged; the monitor then starts empty, as it would without one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from prometheus_client import CollectorRegistry, Counter

from control_plane.json_files import write_json_atomic
from data_plane.common.crypto import ENVELOPE_VERSION, NONCE_BYTES, Keyring

log = logging.getLogger(__name__)

STATE_FILE = "abuse.json"
FORMAT_VERSION = 1
KEY_INFO = b"switchboard control-plane abuse state v1"
"""HKDF label of the key derived from the cluster token (differs from the transcripts' and KV blocks')."""
AAD = b"switchboard-abuse-state-v1\x00"


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class AbuseStateMetrics:
    """``switchboard_abuse_state_ops_total{op, result}``: saves (ok|error) and loads (ok|error|none)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ops = Counter("switchboard_abuse_state_ops", "The abuse monitor's state at rest: saves (ok|error) and "
                           "loads at start (ok|error|none).", ["op", "result"], registry=registry)
        for op, result in (("save", "ok"), ("save", "error"), ("load", "ok"), ("load", "error"), ("load", "none")):
            self.ops.labels(op, result)


class AbuseStateFile:
    """See the module docstring."""

    def __init__(self, path: Path, keys: Keyring, registry: CollectorRegistry | None = None) -> None:
        self.path = path
        self.keys = keys
        self._aead = {kid: AESGCM(key) for kid, key in keys.keys.items()}
        self._ops = AbuseStateMetrics(registry or CollectorRegistry()).ops

    def seal(self, state: dict[str, Any]) -> str:
        nonce = os.urandom(NONCE_BYTES)
        kid = self.keys.current
        body = self._aead[kid].encrypt(nonce, json.dumps(state, separators=(",", ":")).encode(), AAD)
        return f"{ENVELOPE_VERSION}.{kid}.{_b64e(nonce)}.{_b64e(body)}"

    def open(self, envelope: str) -> dict[str, Any]:
        version, kid, nonce, body = envelope.split(".")
        if version != ENVELOPE_VERSION:
            raise ValueError(f"envelope {version!r}")
        aead = self._aead.get(kid)
        if aead is None:
            raise ValueError(f"sealed with key {kid!r}, which is not listed")
        state = json.loads(aead.decrypt(_b64d(nonce), _b64d(body), AAD))
        if not isinstance(state, dict):
            raise ValueError("not an object")
        return state

    def save(self, state: dict[str, Any]) -> None:
        """Write `state` sealed, atomically; a failure is logged and counted, never raised."""
        try:
            write_json_atomic(self.path, {"version": FORMAT_VERSION, "sealed": self.seal(state)})
        except OSError as exc:
            self._ops.labels("save", "error").inc()
            log.error("abuse state: cannot write %s (%s); the actions in force stay in memory", self.path, exc)
            return
        self._ops.labels("save", "ok").inc()

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None (no file; or one that cannot be opened, moved aside)."""
        if not self.path.exists():
            self._ops.labels("load", "none").inc()
            return None
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')!r}")
            state = self.open(str(data["sealed"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidTag) as exc:
            self._ops.labels("load", "error").inc()
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("abuse state: cannot open %s (%s: %s); moved to %s, starting without it", self.path,
                      type(exc).__name__, exc or "tampered or another key", aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return None
        self._ops.labels("load", "ok").inc()
        return state


def open_state_file(state_dir: Path | None, *, keys_file: Path | None, cluster_token: str | None,
                    registry: CollectorRegistry | None = None) -> AbuseStateFile | None:
    """The state file under `state_dir`, or None (no state dir, or no key that a restart would have)."""
    if state_dir is None:
        return None
    if keys_file is None and not cluster_token:
        log.warning("abuse state: no --state-keys-file and no cluster token to seal it with; abuse actions "
                    "will not survive a control-plane restart")
        return None
    keys = Keyring.from_file(keys_file) if keys_file is not None else Keyring.derived(cluster_token or "", KEY_INFO)
    log.info("abuse state sealed at rest in %s (AES-256-GCM, key %s, %s)", state_dir / STATE_FILE, keys.current,
             keys.source)
    return AbuseStateFile(state_dir / STATE_FILE, keys, registry)


__all__ = ["AAD", "KEY_INFO", "STATE_FILE", "AbuseStateFile", "AbuseStateMetrics", "open_state_file"]
