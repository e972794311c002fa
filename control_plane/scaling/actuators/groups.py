"""Pipeline groups as replicas: one replica is a whole group of stage processes placed across nodes.

Built by the ``kubernetes`` and ``nomad`` factories (control_plane/scaling/actuators/__init__.py)
when ``--pipeline-group-template`` is set; the autoscaler loop drives a group actuator like any other.
The schedulers' halves are :mod:`.kubernetes_groups` (a StatefulSet + headless Service a group) and
:mod:`.nomad_groups` (a job a group); this module holds what they share:

    names = GroupNames.of_template("switchboard-pp-a")   # the template's own group is "a"
    names.name(0)                                      # "switchboard-pp-0"
    names.rewrite(spec, 0)                             # every "switchboard-pp-a" in spec's strings renamed
    await groups.current()            # groups asked for: starting ones included, ones being removed not
    await groups.scale_to(3, reason)  # creates groups with the lowest free ids / removes the highest ids

A group's id is a number, its objects are named ``<prefix><id>``, where the prefix is the template's
name up to its last ``-``. A group being removed keeps its id until the scheduler has stopped it, so a
new group never takes the name of one still stopping (its pods, its Consul service).
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeVar

from control_plane.scaling.actuators import ActuatorError

log = logging.getLogger(__name__)

MANAGED_BY = "switchboard-control-plane"
"""Marks the groups the control plane created (a label on Kubernetes, job meta on Nomad): groups
placed by hand from the same spec are neither counted nor removed."""

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """One group as the scheduler lists it."""

    id: int
    live: bool = True
    """False: asked to stop and still stopping, or a job of a group's name that the control plane did
    not create: not counted, and its id not free."""


@dataclass(frozen=True)
class GroupNames:
    """Names of the groups made from one template: ``<prefix><id>``."""

    template_name: str
    """The template's own name, rewritten wherever it occurs (``switchboard-pp-a``)."""
    prefix: str
    """Every group's name starts with it (``switchboard-pp-``)."""

    @classmethod
    def of_template(cls, name: str) -> GroupNames:
        prefix, dash, own_id = name.rpartition("-")
        if not (prefix and dash and own_id):
            raise ActuatorError(f"pipeline group template: name {name!r} is not <prefix>-<group id>")
        return cls(name, prefix + dash)

    def name(self, group_id: int) -> str:
        return f"{self.prefix}{group_id}"

    def id_of(self, name: str) -> int | None:
        """The group id in `name`, or None when `name` is not a group of this template."""
        rest = name.removeprefix(self.prefix)
        return int(rest) if rest != name and rest.isdigit() and str(int(rest)) == rest else None

    def rewrite(self, spec: T, group_id: int) -> T:
        """A copy of `spec` (JSON-like) with the template's name replaced by group `group_id`'s in
        every string: object names, the address stage 0 is joined at, a Consul service name."""
        pattern = re.compile(re.escape(self.template_name) + r"(?![A-Za-z0-9])")
        new = self.name(group_id)

        def walk(value: object) -> object:
            if isinstance(value, str):
                return pattern.sub(new, value)
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}  # keys (labels, meta) stay
            if isinstance(value, list):
                return [walk(v) for v in value]
            return value

        return walk(spec)  # type: ignore[return-value]


def free_ids(taken: set[int], count: int) -> list[int]:
    """The `count` lowest ids not in `taken`."""
    out: list[int] = []
    candidate = 0
    while len(out) < count:
        if candidate not in taken:
            out.append(candidate)
        candidate += 1
    return out


class GroupActuator(ABC):
    """Scales by whole groups; a subclass lists, creates and removes one scheduler's groups."""

    async def current(self) -> int:
        return sum(1 for g in await self._list() if g.live)

    async def scale_to(self, n: int, reason: str) -> None:
        if n < 0:
            raise ActuatorError(f"cannot scale to {n} pipeline groups")
        groups = await self._list()
        live = sorted(g.id for g in groups if g.live)
        for group_id in free_ids({g.id for g in groups}, n - len(live)):
            log.info("creating pipeline group %d: %s", group_id, reason)
            await self._create(group_id, reason)
        for group_id in reversed(live[n:]):  # the highest ids first: the names stay dense
            log.info("removing pipeline group %d: %s", group_id, reason)
            await self._remove(group_id, reason)

    async def aclose(self) -> None:
        """Nothing of the groups is released: they belong to the scheduler."""

    @abstractmethod
    async def _list(self) -> list[Group]:
        """This template's groups, stopping ones included."""

    @abstractmethod
    async def _create(self, group_id: int, reason: str) -> None:
        """Ask the scheduler for group `group_id` (returns once accepted)."""

    @abstractmethod
    async def _remove(self, group_id: int, reason: str) -> None:
        """Ask the scheduler to stop group `group_id` (returns once accepted)."""
