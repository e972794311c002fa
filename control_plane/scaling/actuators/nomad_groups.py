"""The ``nomad`` actuator for pipeline groups: a group is one job (a task group per stage,
``distinct_hosts``), registered from a job file (deploy/nomad/switchboard-pipeline.nomad.hcl).

Built by ``build_actuator`` (control_plane/scaling/actuators/__init__.py) for ``--actuator nomad
--pipeline-group-template PATH``; the autoscaler loop (control_plane/scaling/loop.py) calls it.

    groups = NomadGroups(NomadClient(http, addr="http://127.0.0.1:4646"), Path("switchboard-pipeline.nomad.hcl"))
    await groups.current()   # GET /v1/jobs?prefix=switchboard-pp-&meta=true -> jobs named <prefix><n>
    await groups.scale_to(3, "waiting above target")
        # once:            POST /v1/jobs/parse {"JobHCL": <the file>, "Canonicalize": true}
        #                  (a .json file, `nomad job run -output`'s form, is used as it is)
        # a new group:     POST /v1/jobs {"Job": <the job, renamed>}
        # a removed group: DELETE /v1/job/<prefix><n>

Group ``g`` is the template job with every ``switchboard-pp-a`` (the template's job ID) renamed
``switchboard-pp-g``: the job's ID and name, stage 0's store service in Consul and the template that
renders the other stages' ``--join`` address from it; its meta gains ``switchboard_pipeline_group = g``
and ``switchboard_managed_by``. Variables keep the file's defaults (the parse API is given none): set
them in the file, or pass the JSON that ``nomad job run -output -var ... FILE`` prints.

Counting: a job counts from registration until it is stopped (stages still starting included); a
stopped job still stopping keeps its ID, a dead one's ID is free (registering it again revives it).
Where Nomad lists jobs' meta (``meta=true``, Nomad 1.6+), a job of a group's name that the control plane
did not register is neither counted nor stopped, and its name is skipped; on older agents, keep
hand-run jobs off ``<prefix><number>`` names.
Removing: Nomad stops the allocations, each after its group's ``shutdown_delay`` (stage 0 leaves
Consul first) and ``kill_signal``. ACL: ``list-jobs``, ``read-job``, ``submit-job`` (register,
deregister) and ``parse-job`` on the namespace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from control_plane.scaling.actuators import ActuatorError
from control_plane.scaling.actuators.groups import MANAGED_BY, Group, GroupActuator, GroupNames
from control_plane.scaling.actuators.nomad import NomadClient

if TYPE_CHECKING:
    import httpx

    from control_plane.settings import ControlPlaneSettings

META_GROUP, META_MANAGED_BY = "switchboard_pipeline_group", "switchboard_managed_by"
"""Job meta of a group the control plane registered."""


class NomadGroups(GroupActuator):
    """Pipeline groups as Nomad jobs; see the module docstring."""

    def __init__(self, api: NomadClient, template: Path | str) -> None:
        self._api, self._path = api, Path(template)
        try:
            self._text = self._path.read_text()
        except OSError as exc:
            raise ActuatorError(f"pipeline group template {template}: {exc}") from exc
        self._job: dict[str, Any] | None = None

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, http: httpx.AsyncClient, template: Path) -> NomadGroups:
        return cls(NomadClient.from_settings(settings, http), template)

    async def _template(self) -> tuple[dict[str, Any], GroupNames]:
        """The template job (parsed by Nomad once) and its groups' names."""
        if self._job is None:
            if self._path.suffix == ".json":
                try:
                    parsed = json.loads(self._text)
                except ValueError as exc:
                    raise ActuatorError(f"pipeline group template {self._path}: {exc}") from exc
                parsed = parsed.get("Job", parsed) if isinstance(parsed, dict) else parsed
            else:
                parsed = await self._api.request(
                    "POST", "/v1/jobs/parse", {"JobHCL": self._text, "Canonicalize": True}
                )
            if not isinstance(parsed, dict) or not isinstance(parsed.get("ID"), str):
                raise ActuatorError(f"pipeline group template {self._path}: no job ID in {str(parsed)[:200]}")
            self._job = parsed
        return self._job, GroupNames.of_template(self._job["ID"])

    async def _list(self) -> list[Group]:
        _, names = await self._template()
        jobs = await self._api.request("GET", "/v1/jobs", params={"prefix": names.prefix, "meta": "true"})
        if not isinstance(jobs, list):
            raise ActuatorError(f"nomad listed {type(jobs).__name__}, expected an array of jobs")
        groups = []
        for stub in jobs:
            group_id = names.id_of(str(stub.get("ID", "")))
            meta = stub.get("Meta")
            if group_id is None or stub.get("Status") == "dead":
                continue
            # a job of a group's name that the control plane did not register: not ours to count or
            # stop, and registering ours under its name would replace it
            ours = not isinstance(meta, dict) or meta.get(META_MANAGED_BY) == MANAGED_BY
            groups.append(Group(group_id, live=ours and not stub.get("Stop")))
        return groups

    async def _create(self, group_id: int, reason: str) -> None:
        template, names = await self._template()
        job = names.rewrite(template, group_id)
        job["Meta"] = {**(job.get("Meta") or {}), META_GROUP: str(group_id), META_MANAGED_BY: MANAGED_BY}
        await self._api.request("POST", "/v1/jobs", {"Job": job})

    async def _remove(self, group_id: int, reason: str) -> None:
        _, names = await self._template()
        await self._api.request("DELETE", f"/v1/job/{quote(names.name(group_id), safe='')}", ok=(200, 404))
