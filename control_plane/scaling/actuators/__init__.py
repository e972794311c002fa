"""Actuators: how the autoscaler changes the number of shards. One small interface, three ways.

    actuator = build_actuator(settings, http)       # by --actuator: local | nomad | kubernetes
    n = await actuator.current()                    # replicas asked for / starting / running
    await actuator.scale_to(n + 1, "waiting above target")
    await actuator.aclose()

- ``local`` (:mod:`.local`): starts and stops ``switchboard shard`` processes on this machine;
  a shard being removed is drained first (stops admitting, finishes in flight, deregisters).
- ``nomad`` (:mod:`.nomad`): Nomad's job scale API; Nomad places the allocations and registers
  the shards in Consul itself.
- ``kubernetes`` (:mod:`.kubernetes`): the ``scale`` subresource of the shards' Deployment.

With ``--pipeline-group-template`` the ``nomad`` and ``kubernetes`` actuators scale pipeline groups
placed across nodes instead, one replica a whole group (:mod:`.groups`): a job a group
(:mod:`.nomad_groups`), a StatefulSet + headless Service a group (:mod:`.kubernetes_groups`).

Errors: every adapter maps its transport and API failures to :class:`ActuatorError`, once, at
its boundary; the autoscaler records them as the decision's outcome and carries on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import httpx

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings


class ActuatorError(Exception):
    """Scaling could not be read or carried out (unreachable API, refused request, bad answer)."""


class ActuatorCapped(ActuatorError):
    """Scaled as far as the actuator can go, short of what was asked (the local actuator's host is
    full: more shard processes than its cores would slow every shard instead of adding capacity)."""


class Actuator(Protocol):
    """What the autoscaler drives. Called from its task, one call at a time."""

    async def current(self) -> int:
        """Replicas the scheduler is asked to run now (starting ones included, draining ones not)."""
        ...

    async def scale_to(self, n: int, reason: str) -> None:
        """Ask for `n` replicas; returns once the request is accepted (not once they run)."""
        ...

    async def aclose(self) -> None:
        """Release what the actuator owns (the local one stops its shard processes)."""
        ...


def _local(settings: ControlPlaneSettings, http: httpx.AsyncClient) -> Actuator:
    from control_plane.scaling.actuators.local import LocalActuator

    return LocalActuator.from_settings(settings, http)


def _nomad(settings: ControlPlaneSettings, http: httpx.AsyncClient) -> Actuator:
    if settings.pipeline_group_template is not None:
        from control_plane.scaling.actuators.nomad_groups import NomadGroups

        return NomadGroups.from_settings(settings, http, settings.pipeline_group_template)
    from control_plane.scaling.actuators.nomad import NomadActuator

    return NomadActuator.from_settings(settings, http)


def _kubernetes(settings: ControlPlaneSettings, http: httpx.AsyncClient) -> Actuator:
    if settings.pipeline_group_template is not None:
        from control_plane.scaling.actuators.kubernetes_groups import KubernetesGroups

        return KubernetesGroups.from_settings(settings, settings.pipeline_group_template)
    from control_plane.scaling.actuators.kubernetes import KubernetesActuator

    return KubernetesActuator.from_settings(settings)


ACTUATORS = {"local": _local, "nomad": _nomad, "kubernetes": _kubernetes}
"""Actuator factories by ``--actuator`` name."""


def build_actuator(settings: ControlPlaneSettings, http: httpx.AsyncClient) -> Actuator:
    name = getattr(settings, "actuator", "local")
    try:
        factory = ACTUATORS[name]
    except KeyError:
        raise ValueError(f"unknown actuator {name!r}; expected one of {', '.join(ACTUATORS)}") from None
    return factory(settings, http)


__all__ = ["ACTUATORS", "Actuator", "ActuatorError", "build_actuator"]
