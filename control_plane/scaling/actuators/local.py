"""The ``local`` actuator: ``switchboard shard`` processes on this machine.

    actuator = LocalActuator("http://127.0.0.1:8300", http, shard_args=["--engine", "synthetic"])
    await actuator.scale_to(2, "min_replicas")      # starts two shards on free loopback ports
    await actuator.scale_to(1, "low load")          # drains one, then stops it
    actuator.shards()                               # [{"id", "url", "pid", "state", "log"}, ...]
    await actuator.aclose()                         # stops every shard it started

Each shard runs ``python -m control_plane.cli shard --host H --port P --registry-url R
--node-id shard-local-P <shard_args>`` with its output in ``<log_dir>/shard-local-P.log``.
Removing a shard (newest first): ``POST /admin/v1/members/{id}/drain`` (admin token) so routers stop
sending it work, wait until its ``/health`` shows ``running == 0`` and ``waiting == 0`` for
`settle_s` (or `drain_timeout_s` passes), then SIGTERM: the shard finishes what is left and
deregisters; SIGKILL after `stop_timeout_s`. A shard process that dies is forgotten (and logged),
so ``current()`` drops and the autoscaler replaces it. A shard never outlives the control plane that
started it: a parent-death signal (data_plane/common/lifeline.py) kills it when the control plane
dies without stopping it (kill -9, a crash). Start shards from the event loop's thread (it forks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from control_plane.scaling.actuators import ActuatorCapped, ActuatorError
from data_plane.common.http_server import free_port
from data_plane.common.lifeline import die_with_parent
from data_plane.common.tasks import stop_tasks
from data_plane.common.tls import TlsConfig

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

log = logging.getLogger(__name__)


@dataclass
class _Shard:
    id: str
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path
    started_at: float
    state: str = "running"  # running | draining | stopping


class LocalActuator:
    """Starts and stops shard processes; see the module docstring."""

    def __init__(
        self,
        registry_url: str,
        http: httpx.AsyncClient,
        *,
        shard_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_dir: Path | str = Path(".switchboard/logs"),
        drain_timeout_s: float = 30.0,
        settle_s: float = 0.5,
        stop_timeout_s: float = 15.0,
        poll_interval_s: float = 0.2,
        python: str = sys.executable,
        admin_token: str | None = None,
        max_shards: int = 0,
    ) -> None:
        self._max_shards = max_shards
        self._registry_url = registry_url.rstrip("/")
        self._admin_token = admin_token
        self._http = http
        self._shard_args = list(shard_args)
        self._host = host
        self._log_dir = Path(log_dir)
        self._drain_timeout_s = drain_timeout_s
        self._settle_s = settle_s
        self._stop_timeout_s = stop_timeout_s
        self._poll_s = poll_interval_s
        self._python = python
        self._shards: dict[str, _Shard] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}
        self.zone_for_new: Callable[[], str | None] | None = None
        """Set by the control plane (ZoneWatch.zone_for_new_shard): the zone a new shard joins."""

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, http: httpx.AsyncClient) -> LocalActuator:
        host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return cls(
            f"{TlsConfig.from_env().scheme}://{host}:{settings.port}",  # `up --tls`: the control plane is https
            http,
            shard_args=shlex.split(settings.shard_args or ""),
            host=host,
            log_dir=settings.shard_log_dir,
            drain_timeout_s=settings.drain_timeout_s,
            max_shards=settings.local_max_shards,
            admin_token=settings.admin_token.get_secret_value() if settings.admin_token else None,
        )

    # -- Actuator --------------------------------------------------------------------------

    async def current(self) -> int:
        self._reap()
        return sum(1 for s in self._shards.values() if s.state == "running")

    async def scale_to(self, n: int, reason: str) -> None:
        if n < 0:
            raise ActuatorError(f"cannot scale to {n}")
        have = await self.current()
        asked, n = n, min(n, self._max_shards) if self._max_shards else n
        if n > have:
            for _ in range(n - have):
                await self._start(reason)
        elif n < have:
            running = sorted(
                (s for s in self._shards.values() if s.state == "running"),
                key=lambda s: s.started_at,
                reverse=True,
            )
            for shard in running[: have - n]:
                shard.state = "draining"
                log.info("draining %s (%s): %s", shard.id, shard.url, reason)
                self._drains[shard.id] = asyncio.create_task(
                    self._drain_and_stop(shard), name=f"local-actuator-drain:{shard.id}"
                )
        if asked > n:
            raise ActuatorCapped(f"this host holds {n} shards (--local-max-shards); {asked} asked")

    async def aclose(self) -> None:
        """Stop every shard this actuator started (drains in progress are cut short)."""
        await stop_tasks(*self._drains.values())
        await asyncio.gather(*(self._stop(s) for s in list(self._shards.values())))

    # -- introspection ---------------------------------------------------------------------

    def shards(self) -> list[dict[str, Any]]:
        """The processes this actuator owns: ``{id, url, pid, state, log}``, oldest first."""
        self._reap()
        return [
            {"id": s.id, "url": s.url, "pid": s.proc.pid, "state": s.state, "log": str(s.log_path)}
            for s in sorted(self._shards.values(), key=lambda s: s.started_at)
        ]

    async def wait_drained(self) -> None:
        """Wait for the drains in progress (tests)."""
        await asyncio.gather(*self._drains.values(), return_exceptions=True)

    # -- internals -------------------------------------------------------------------------

    async def _start(self, reason: str) -> _Shard:
        port = free_port(self._host)
        member_id = f"shard-local-{port}"
        url = f"{TlsConfig.from_env().scheme}://{self._host}:{port}"  # it inherits our TLS environment
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{member_id}.log"
        args = [
            self._python,
            "-m",
            "control_plane.cli",
            "shard",
            "--host",
            self._host,
            "--port",
            str(port),
            "--registry-url",
            self._registry_url,
            "--node-id",
            member_id,
            *self._shard_args,
        ]
        zone = self.zone_for_new() if self.zone_for_new is not None and "--zone" not in self._shard_args else None
        if zone is not None:
            args += ["--zone", zone]
            log.info("starting %s in zone %s: %s", member_id, zone, reason)
        try:
            with open(log_path, "ab") as out:  # noqa: ASYNC230 (a local file, once per shard start)
                proc = await asyncio.create_subprocess_exec(
                    *args,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # our signals, in our order; not the terminal's Ctrl-C
                    preexec_fn=die_with_parent(),  # the control plane killed or crashed: they go too
                )
        except OSError as exc:
            raise ActuatorError(f"cannot start a shard: {exc}") from exc
        shard = _Shard(member_id, url, proc, log_path, time.monotonic())
        self._shards[member_id] = shard
        log.info("started %s at %s (pid %d, log %s): %s", member_id, url, proc.pid, log_path, reason)
        return shard

    def _reap(self) -> None:
        for shard in list(self._shards.values()):
            code = shard.proc.returncode
            if code is not None and shard.state == "running":
                log.warning("%s exited on its own (code %s); see %s", shard.id, code, shard.log_path)
                del self._shards[shard.id]

    async def _drain_and_stop(self, shard: _Shard) -> None:
        try:
            if await self._mark_draining(shard):
                await self._wait_idle(shard)
            await self._stop(shard)
            await self._clear_mark(shard)
        finally:
            self._drains.pop(shard.id, None)

    async def _mark_draining(self, shard: _Shard) -> bool:
        """Ask the registry to drain `shard`; False when it is not registered (nothing routes to it)."""
        # Draining is an operator action: the admin API, with the admin token.
        url = f"{self._registry_url}/admin/v1/members/{shard.id}/drain"
        headers = {"Authorization": f"Bearer {self._admin_token}"} if self._admin_token else {}
        try:
            resp = await self._http.post(url, timeout=2.0, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("could not drain %s (%s); waiting for it to go idle anyway", shard.id, exc)
            return True
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            log.warning("draining %s: registry answered %d %s", shard.id, resp.status_code, resp.text[:200])
        return True

    async def _clear_mark(self, shard: _Shard) -> None:
        """Undrain a stopped shard's id: one that had to be killed never deregistered, and its drain
        mark (kept across control-plane restarts) would leave the next shard started on its port, so
        under its id, drained while counted as capacity. 404: nothing to clear (it deregistered)."""
        url = f"{self._registry_url}/admin/v1/members/{shard.id}/undrain"
        headers = {"Authorization": f"Bearer {self._admin_token}"} if self._admin_token else {}
        try:
            await self._http.post(url, timeout=2.0, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("could not clear the drain mark of %s (%s)", shard.id, exc)

    async def _wait_idle(self, shard: _Shard) -> None:
        deadline = time.monotonic() + self._drain_timeout_s
        idle_since: float | None = None
        while time.monotonic() < deadline and shard.proc.returncode is None:
            try:
                body = (await self._http.get(shard.url + "/health", timeout=1.0)).json()
                idle = body.get("running") == 0 and body.get("waiting") == 0
            except (httpx.HTTPError, ValueError):
                idle = False
            now = time.monotonic()
            if not idle:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= self._settle_s:
                log.info("%s drained (idle for %.1fs)", shard.id, self._settle_s)
                return
            await asyncio.sleep(self._poll_s)
        if shard.proc.returncode is None:
            log.warning(
                "%s still busy after the %.0fs drain timeout; stopping it", shard.id, self._drain_timeout_s
            )

    async def _stop(self, shard: _Shard) -> None:
        shard.state = "stopping"
        proc = shard.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self._stop_timeout_s)
            except TimeoutError:
                log.warning("%s ignored SIGTERM for %.0fs; killing it", shard.id, self._stop_timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        log.info("stopped %s (code %s)", shard.id, proc.returncode)
        self._shards.pop(shard.id, None)
