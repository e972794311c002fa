"""The gateway's API keys: loaded at start from its keys file and environment, and reloaded when the
keys file changes, so revoking a key (the runbook: remove it from the keys file) takes effect.

    keys = load_keys(settings)                                   # at start: SystemExit without any key
    reload = KeysFileReload(settings.keys_file, lambda: checked_keys(settings, tiers), swap)
    reload = KeysFileReload(settings.keys_file, lambda: hot_keys(settings, policy), swap)  # a control plane's
    reload.start()                                               # checks the file every RELOAD_S
    await reload.aclose()

Why: the key store was built once, at start. A key removed from the file (a leaked key, a tenant who
left, an abuse confirmed) went on authenticating until every gateway was restarted, and nothing said
so. The file is stat-ed every second (modification time, size, inode: an editor's rename counts); a
changed file is parsed and validated whole before it replaces the keys in force, so a half-written or
invalid file never locks everyone out: it is logged and the previous keys stay. Keys that a new version
lacks also end the requests they have in flight (data_plane/gateway/revocation.py, via `Gateway.put_keys`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import yaml

from data_plane.common.tasks import every, stop_tasks
from data_plane.gateway.auth import KeyStore
from data_plane.gateway.settings import GatewaySettings
from data_plane.tiers import TierPolicy

log = logging.getLogger(__name__)

RELOAD_S = 1.0
"""How often the keys file is checked for a change: a revoked key stops working within about this."""


def load_keys(settings: GatewaySettings) -> KeyStore:
    """The keys file's keys and the environment's, merged (a key given two principals: ValueError)."""
    stores = []
    if settings.keys_file:
        stores.append(KeyStore.from_yaml(settings.keys_file))
    if settings.api_keys:
        stores.append(KeyStore.from_env(settings.api_keys))
    if not stores:
        raise SystemExit("switchboard gateway: no API keys configured; pass --keys-file or "
                         "SWITCHBOARD_GATEWAY_API_KEYS='key:tenant:tier' (`switchboard up` makes dev keys)")
    return KeyStore.merged(*stores)


def checked_keys(settings: GatewaySettings, tiers: TierPolicy) -> KeyStore:
    """:func:`load_keys`, every key's tier known to the tier policy (else ValueError): a gateway without
    a control plane, whose tiers are its own for good (a tier named wrong is a bad edit)."""
    keys = load_keys(settings)
    keys.validate_tiers(tiers.names())
    return keys


def hot_keys(settings: GatewaySettings, policy: Callable[[], TierPolicy]) -> KeyStore:
    """:func:`load_keys` for a gateway with a control plane, whose tiers come and go there (the console's
    tier editor, PUT /admin/v1/tiers): a key of a tier the `policy` in force lacks is loaded and logged,
    and refused when used (403 tier_removed). Checked instead, the whole file was refused while one of its
    keys named a tier the policy lacked: one added on the console and not yet seen here, one removed
    there, the control plane unreachable; meanwhile every revocation (a key removed) went unapplied."""
    keys = load_keys(settings)
    unknown = {p.tier for p in keys.principals()} - set(policy().names())
    if unknown:
        log.warning("API keys name tiers not in the tier policy in force (%s): refused (403 tier_removed) "
                    "until a policy names them", ", ".join(sorted(unknown)))
    return keys


class KeysFileReload:
    """Puts the keys file's new content in force when it changes (see the module's docstring)."""

    def __init__(self, path: str, load: Callable[[], KeyStore], apply: Callable[[KeyStore], None],
                 interval_s: float = RELOAD_S) -> None:
        self.path = path
        self.load = load
        self.apply = apply
        self.interval_s = interval_s
        self._seen = self._stamp()
        self._task: asyncio.Task[None] | None = None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def check(self) -> bool:
        """Reload if the file changed since the last look; True when new keys were put in force."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp  # a bad version is reported once, not every second
        if stamp is None:
            log.error("API keys file %s is gone; the keys loaded before stay in force", self.path)
            return False
        try:
            keys = self.load()
        except (OSError, ValueError, yaml.YAMLError) as exc:
            log.error("API keys file %s changed but was not loaded (%s); the keys loaded before stay in force",
                      self.path, exc)
            return False
        self.apply(keys)
        log.info("API keys reloaded from %s: %d keys in force", self.path, len(keys))
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(every(self.interval_s, self.check, "API keys reload", log))

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None


__all__ = ["RELOAD_S", "KeysFileReload", "checked_keys", "hot_keys", "load_keys"]
