"""The ``nomad`` actuator: Nomad's job scale API, for a task group of shards; and
:class:`NomadClient`, its calls to Nomad's HTTP API, which the pipeline-group variant
(:mod:`.nomad_groups`, built instead with ``--pipeline-group-template``) shares.

Built by ``build_actuator`` (control_plane/scaling/actuators/__init__.py) for ``--actuator nomad``;
the autoscaler loop (control_plane/scaling/loop.py) calls it.

    actuator = NomadActuator(http, addr="http://127.0.0.1:4646", job="switchboard", group="shard")
    await actuator.current()              # GET  /v1/job/switchboard/scale -> TaskGroups.shard.Desired
    await actuator.scale_to(3, "waiting above target")
                                          # POST /v1/job/switchboard/scale
                                          #   {"Count": 3, "Target": {"Group": "shard"}, "Message": ...}

Nomad places (and on scale-down stops) the allocations and registers the shards in Consul
itself, from the job's ``service`` block (``deploy/nomad/switchboard.nomad.hcl``). With ACLs the
token needs ``read-job-scaling`` and ``scale-job`` on the job's namespace (``X-Nomad-Token``).
A removed allocation gets the group's ``kill_signal`` after ``shutdown_delay``: the job file sets
both so a shard leaves Consul first and finishes its in-flight requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from control_plane.scaling.actuators import ActuatorError

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

TOKEN_HEADER = "X-Nomad-Token"


class NomadClient:
    """Nomad's HTTP API as these actuators use it: the ACL token, namespace and region on every call,
    transport failures and non-200 answers mapped to :class:`ActuatorError`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        addr: str = "http://127.0.0.1:4646",
        namespace: str | None = None,
        region: str | None = None,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._http = http
        self.addr = addr.rstrip("/")
        self._params = {k: v for k, v in (("namespace", namespace), ("region", region)) if v}
        self._headers = {TOKEN_HEADER: token} if token else {}
        self._timeout_s = timeout_s

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, http: httpx.AsyncClient) -> NomadClient:
        token = settings.nomad_token.get_secret_value() if settings.nomad_token is not None else None
        return cls(
            http, addr=settings.nomad_addr, namespace=settings.nomad_namespace, region=settings.nomad_region,
            token=token,
        )

    async def request(
        self,
        method: str,
        path: str,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> Any:
        """The JSON answer to ``METHOD addr+path`` (an object or, for lists, an array) when its status
        is in `ok` (None for an empty body); any other status is an ActuatorError."""
        url = self.addr + path
        try:
            resp = await self._http.request(
                method,
                url,
                params={**self._params, **(params or {})},
                headers=self._headers,
                json=json,
                timeout=self._timeout_s,
            )
        except httpx.HTTPError as exc:
            raise ActuatorError(f"nomad at {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code not in ok:
            raise ActuatorError(f"nomad {method} {url} answered {resp.status_code}: {resp.text[:300]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as exc:
            raise ActuatorError(f"nomad answered non-JSON: {resp.text[:200]}") from exc


class NomadActuator:
    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        addr: str = "http://127.0.0.1:4646",
        job: str = "switchboard",
        group: str = "shard",
        namespace: str | None = None,
        region: str | None = None,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._api = NomadClient(http, addr=addr, namespace=namespace, region=region, token=token, timeout_s=timeout_s)
        self._path = f"/v1/job/{quote(job, safe='')}/scale"
        self.job, self.group = job, group

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, http: httpx.AsyncClient) -> NomadActuator:
        token = settings.nomad_token.get_secret_value() if settings.nomad_token is not None else None
        return cls(
            http,
            addr=settings.nomad_addr,
            job=settings.nomad_job,
            group=settings.nomad_group,
            namespace=settings.nomad_namespace,
            region=settings.nomad_region,
            token=token,
        )

    async def current(self) -> int:
        body = await self._call("GET")
        groups = body.get("TaskGroups") or {}
        if self.group not in groups:
            raise ActuatorError(
                f"nomad job {self.job!r} has no task group {self.group!r} "
                f"(groups: {', '.join(groups) or 'none'})"
            )
        if body.get("JobStopped"):
            return 0
        return int(groups[self.group].get("Desired") or 0)

    async def scale_to(self, n: int, reason: str) -> None:
        await self._call(
            "POST",
            json={
                "Count": n,
                "Target": {"Group": self.group},
                "Message": reason[:500],
                "Meta": {"source": "switchboard-autoscaler"},
            },
        )

    async def aclose(self) -> None:
        """Nothing to release: the http client belongs to the process."""

    async def _call(self, method: str, json: dict[str, Any] | None = None) -> dict[str, Any]:
        body = await self._api.request(method, self._path, json)
        if not isinstance(body, dict):
            raise ActuatorError(f"nomad answered {type(body).__name__}, expected an object")
        return body
