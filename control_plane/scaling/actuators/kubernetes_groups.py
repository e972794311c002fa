"""The ``kubernetes`` actuator for pipeline groups: a group is a StatefulSet (its pods the stages) and
a headless Service, made from a template (deploy/kubernetes/pipeline-nodes/group.yaml).

Built by ``build_actuator`` (control_plane/scaling/actuators/__init__.py) for ``--actuator kubernetes
--pipeline-group-template PATH``; the autoscaler loop (control_plane/scaling/loop.py) calls it.

    groups = KubernetesGroups(KubeClient.from_kubeconfig(namespace="switchboard"), GroupTemplate.load(path))
    await groups.current()   # GET /apis/apps/v1/namespaces/NS/statefulsets?labelSelector=<the groups'>
    await groups.scale_to(3, "waiting above target")
        # a new group:     POST /api/v1/namespaces/NS/services, then POST /apis/apps/v1/.../statefulsets
        # a removed group: DELETE .../statefulsets/NAME (propagationPolicy Foreground), then .../services/NAME

Group ``g`` is the template with every ``switchboard-pp-a`` (the template StatefulSet's name) renamed
``switchboard-pp-g`` (the objects, ``serviceName``, the ``--join`` address of stage 0 in the script),
the ``switchboard.dev/pipeline`` label set to ``g`` wherever it appears (labels, selectors, the
anti-affinity term) and ``app.kubernetes.io/managed-by: switchboard-control-plane`` on both objects:
only those are listed, so a group applied by hand from the same file is left alone.

Counting: a group counts from the moment its StatefulSet exists, stages still starting included (stage 0
joins Consul only once every stage joined, minutes for a large model; counting it sooner keeps the
autoscaler from asking twice). A group being deleted does not count.

Why Foreground deletion: the StatefulSet stays, marked deleted, until the garbage collector has removed
its pods, so it stops counting at once but keeps its name until its stages are gone; a new group never
takes the name of pods still terminating (with Background the StatefulSet vanishes at once and a new
group of that id would wait on, and select, the old group's terminating pods). Stage 0 gets SIGTERM,
finishes its in-flight requests and leaves Consul (``terminationGracePeriodSeconds``).

RBAC: ``list``, ``create``, ``delete`` on ``statefulsets`` (apps) and ``services``
(deploy/kubernetes/pipeline-nodes/rbac.yaml). Changing the template changes only the groups created
after the control plane has read it (at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from control_plane.scaling.actuators import ActuatorError
from control_plane.scaling.actuators.groups import MANAGED_BY, Group, GroupActuator, GroupNames
from control_plane.scaling.actuators.kubernetes import KubeClient

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

PIPELINE_LABEL = "switchboard.dev/pipeline"
"""The group id, on the objects and the pods (the StatefulSet's selector and the anti-affinity)."""
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APPS, CORE = "apis/apps/v1", "api/v1"
CREATED = (200, 201, 202)
DELETED = (200, 202, 404)  # 404: already gone
SERVER_SET = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "selfLink")
"""Metadata the API server sets; dropped so a template taken from ``kubectl get -o yaml`` creates."""


@dataclass(frozen=True)
class GroupTemplate:
    """A group's StatefulSet and headless Service, as read from the template file."""

    statefulset: dict[str, Any]
    service: dict[str, Any]

    @classmethod
    def load(cls, path: Path | str) -> GroupTemplate:
        try:
            docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        except (OSError, yaml.YAMLError) as exc:
            raise ActuatorError(f"pipeline group template {path}: {type(exc).__name__}: {exc}") from exc
        kinds = [d.get("kind") if isinstance(d, dict) else None for d in docs]
        if sorted(map(str, kinds)) != ["Service", "StatefulSet"]:
            raise ActuatorError(
                f"pipeline group template {path}: expected one StatefulSet and one Service, found {kinds}"
            )
        sts, svc = (docs[kinds.index(k)] for k in ("StatefulSet", "Service"))
        labels = (sts.get("metadata") or {}).get("labels") or {}
        if PIPELINE_LABEL not in labels:
            raise ActuatorError(f"pipeline group template {path}: the StatefulSet has no {PIPELINE_LABEL} label")
        return cls(sts, svc)

    @property
    def names(self) -> GroupNames:
        return GroupNames.of_template(str(self.statefulset["metadata"]["name"]))

    def label_selector(self) -> str:
        """The template's own labels (not its group id), the manager, and any group id."""
        labels = dict(self.statefulset["metadata"].get("labels") or {})
        labels.pop(PIPELINE_LABEL, None)
        labels[MANAGED_BY_LABEL] = MANAGED_BY
        return ",".join([*(f"{k}={v}" for k, v in sorted(labels.items())), PIPELINE_LABEL])

    def for_group(self, group_id: int, namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(StatefulSet, Service) of group `group_id`, ready to POST."""
        out = []
        for obj in (self.statefulset, self.service):
            spec = _with_label(self.names.rewrite(obj, group_id), str(group_id))
            spec.pop("status", None)
            meta = spec.setdefault("metadata", {})
            for key in SERVER_SET:
                meta.pop(key, None)
            meta["namespace"] = namespace
            meta.setdefault("labels", {})[MANAGED_BY_LABEL] = MANAGED_BY
            out.append(spec)
        return out[0], out[1]


def _with_label(value: Any, group_id: str) -> Any:
    """`value` with every ``switchboard.dev/pipeline`` entry (labels, selectors) set to `group_id`."""
    if isinstance(value, dict):
        return {k: group_id if k == PIPELINE_LABEL else _with_label(v, group_id) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_label(v, group_id) for v in value]
    return value


class KubernetesGroups(GroupActuator):
    """Pipeline groups as StatefulSets; see the module docstring."""

    def __init__(self, api: KubeClient, template: GroupTemplate) -> None:
        self._api, self._template, self._names = api, template, template.names
        self._service_name = str(template.service["metadata"]["name"])

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, template: Path) -> KubernetesGroups:
        return cls(KubeClient.connect(settings), GroupTemplate.load(template))

    async def aclose(self) -> None:
        await self._api.aclose()

    async def _list(self) -> list[Group]:
        _, body = await self._api.request(
            "GET", self._api.path(APPS, "statefulsets"), params={"labelSelector": self._template.label_selector()}
        )
        groups = []
        for item in body.get("items") or []:
            meta = item.get("metadata") or {}
            group_id = self._names.id_of(str(meta.get("name", "")))
            if group_id is not None:
                groups.append(Group(group_id, live=not meta.get("deletionTimestamp")))
        return groups

    async def _create(self, group_id: int, reason: str) -> None:
        sts, svc = self._template.for_group(group_id, self._api.namespace)
        sts["metadata"].setdefault("annotations", {})["switchboard.dev/scaled-for"] = reason[:200]
        # the Service first, so stage 0's name resolves when the stages start; one left by an earlier
        # attempt whose StatefulSet failed (409 AlreadyExists) is this group's own
        await self._api.request("POST", self._api.path(CORE, "services"), svc, ok=(*CREATED, 409))
        await self._api.request("POST", self._api.path(APPS, "statefulsets"), sts, ok=CREATED)

    async def _remove(self, group_id: int, reason: str) -> None:
        name = self._names.name(group_id)
        await self._api.request(
            "DELETE",
            self._api.path(APPS, "statefulsets", name),
            {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"},
            ok=DELETED,
        )
        svc = self._names.rewrite(self._service_name, group_id)
        await self._api.request(
            "DELETE",
            self._api.path(CORE, "services", svc),
            {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            ok=DELETED,
        )
