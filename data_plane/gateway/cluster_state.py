"""What the control plane tells the gateway: the degradation level and the tier policy in force.

    state = HttpClusterState("http://127.0.0.1:8300", http, validate=check_policy)
    await state.start()                 # never raises; keeps the last state if unreachable
    now = state.current()               # ClusterState(index, degradation, tiers), from memory
    effects = Effects(now.degradation)  # what the level means for one request
    effects.admit(tier, policy)         # raises Overloaded (503 + Retry-After) when shed
    effects.max_tokens(512)             # 256 from level 2
    effects.prompt_budget(2032, 2048)   # 1024 from level 1
    await state.aclose()

    StaticClusterState()                # level 0 and the local policy (no control plane)

The watch mirrors :class:`data_plane.membership.embedded.HttpMembership`: blocking queries on
``GET /v1/state?index=N&wait=S`` (served by ``control_plane/state_api.py``), one named task,
backoff while the control plane is unreachable, and the last state seen stays in force
meanwhile (``reachable`` is False). Talks HTTP only: the data plane never imports the control plane.

The control plane's ``state_id`` (the id of its state dir, the same across its restarts) is watched too:
when it changes after the first read (a control plane started with another state dir by mistake, whose
degradation pin, tier edits and abuse actions are not the ones in force before), the gateway still adopts
the new state (the control plane is the authority) but logs an ERROR and calls `on_state_change`
(``switchboard_gateway_control_plane_state_changes_total``, alert SwitchboardControlPlaneStateChanged).
A first id after none (a control plane that had no state dir, or an older one) is no change.

The ladder's effects, per request (the level is read once, when the request starts)::

    >= 1  the prompt window shrinks to half of min(tier, model) context (older turns dropped first)
    >= 2  max_tokens is capped (not refused) at min(request, DEGRADED_MAX_OUTPUT_TOKENS)
    >= 3  tiers first in the shed order (lowest ``shed_order``: free) get 503 overloaded
      4   every tier but the last in the shed order (enterprise) gets 503 overloaded
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from data_plane.common.errors import Overloaded
from data_plane.common.ladder import Level
from data_plane.membership.embedded import BlockingWatcher
from data_plane.tiers import Tier, TierPolicy

log = logging.getLogger(__name__)

DEGRADED_HEADER = "x-switchboard-degraded"
"""Response header carrying the level, on every chat response while the level is above 0."""
SPAN_ATTRIBUTE = "switchboard.degradation_level"
DEGRADED_MAX_OUTPUT_TOKENS = 256
"""Cap on max_tokens from level 2."""
DEFAULT_RETRY_AFTER_S = 30


@dataclass(frozen=True)
class Degradation:
    """The ladder as the control plane last reported it."""

    level: Level = Level.NORMAL
    reason: str = ""
    pinned: bool = False
    since: float = 0.0
    retry_after_s: int = DEFAULT_RETRY_AFTER_S
    """Retry-After sent with shed requests."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Degradation:
        return cls(
            level=Level.parse(data["level"]),
            reason=str(data.get("reason") or ""),
            pinned=bool(data.get("pinned", False)),
            since=float(data.get("since") or 0.0),
            retry_after_s=max(1, int(data.get("retry_after_s") or DEFAULT_RETRY_AFTER_S)),
        )


@dataclass(frozen=True)
class ClusterState:
    index: int = 0
    degradation: Degradation = Degradation()
    tiers: TierPolicy | None = None
    """The control plane's policy; None (it has none of its own, or none was accepted yet) = use
    the gateway's own (``--tiers-file`` or built-in)."""


class ClusterStateView(Protocol):
    """What the gateway reads per request; answers from memory, never over the network."""

    def current(self) -> ClusterState: ...


class StaticClusterState:
    """A fixed state (level 0, local tiers unless given): gateways without a control plane, tests."""

    def __init__(self, state: ClusterState | None = None) -> None:
        self._state = state or ClusterState()

    def current(self) -> ClusterState:
        return self._state


class HttpClusterState(BlockingWatcher):
    """Watches the control plane's ``/v1/state`` with blocking queries; one named task per instance.

    `validate` (optional) is called with each new tier policy before it is put in force; if it
    raises ValueError the policy is refused (logged), the previous one stays, and the level is
    still applied. `subscribe` callbacks run after each change.
    """

    what = "control plane"

    def __init__(
        self,
        url: str,
        http: httpx.AsyncClient,
        *,
        wait_s: float = 5.0,
        validate: Callable[[TierPolicy], None] | None = None,
        on_state_change: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(url.rstrip("/") + "/v1/state", http, wait_s, "cluster-state-watch")
        self._validate = validate
        self._on_state_change = on_state_change
        self._state = ClusterState()
        self._tiers_raw: Any = None
        self.state_id: str | None = None
        """The control plane's state id last read (None: none yet, or it has none)."""

    def current(self) -> ClusterState:
        return self._state

    async def _sync(self, *, wait_s: float, timeout_s: float) -> bool:
        index = self._state.index if self._reachable else 0
        try:
            resp = await self._http.get(self._url, params={"index": index, "wait": wait_s}, timeout=timeout_s)
            resp.raise_for_status()
            body = resp.json()
            new_index = int(body["index"])
            degradation = Degradation.from_dict(body["degradation"])
            tiers_raw = body.get("tiers")
            state_id = body.get("state_id")
            if state_id is not None and not isinstance(state_id, str):
                raise ValueError(f"state_id is {type(state_id).__name__}, not a string")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._unreachable(exc, f"keeping degradation level {self._state.degradation.level} and the last "
                                   "tier policy")
            return False
        self._synced(new_index)
        self._check_state_id(state_id, degradation)
        self._apply(new_index, degradation, tiers_raw)
        return True

    def _check_state_id(self, state_id: str | None, degradation: Degradation) -> None:
        old = self.state_id
        self.state_id = state_id
        if old is None or state_id == old:
            if old is None and state_id is not None:
                log.info("following the control plane's state %s", state_id)
            return
        log.error("the control plane at %s now serves another state (state id %s, was %s): it was started with "
                  "another state dir, or its state dir was replaced; its degradation level %d%s, tier policy "
                  "and abuse actions replace the ones in force (runbook: SwitchboardControlPlaneStateChanged)",
                  self._url, state_id, old, degradation.level, " (pinned)" if degradation.pinned else "")
        if self._on_state_change is not None:
            self._on_state_change()

    def _apply(self, index: int, degradation: Degradation, tiers_raw: Any) -> None:
        old = self._state
        tiers = old.tiers
        if tiers_raw is None:  # the control plane has no policy of its own: use the local one
            self._tiers_raw, tiers = None, None
        elif tiers_raw != self._tiers_raw:
            self._tiers_raw = tiers_raw
            try:
                tiers = TierPolicy.from_dict(tiers_raw)
                if self._validate is not None:
                    self._validate(tiers)
            except ValueError as exc:
                log.error("refusing the control plane's tier policy (keeping the previous one): %s", exc)
                tiers = old.tiers
            else:
                if tiers != old.tiers:
                    log.info("tier policy from the control plane: %s", ", ".join(tiers.names()))
        if degradation.level != old.degradation.level:
            log.log(
                logging.WARNING if degradation.level > old.degradation.level else logging.INFO,
                "degradation level %d -> %d%s: %s", old.degradation.level, degradation.level,
                " (pinned)" if degradation.pinned else "", degradation.reason,
            )
        self._state = ClusterState(index=index, degradation=degradation, tiers=tiers)
        if self._state != old:
            self._notify()


@dataclass(frozen=True)
class Effects:
    """What one degradation level means for one request (see the module docstring)."""

    degradation: Degradation = Degradation()

    @property
    def level(self) -> Level:
        return self.degradation.level

    def max_tokens(self, requested: int) -> int:
        """From level 2, a request's max_tokens is capped, not refused."""
        return min(requested, DEGRADED_MAX_OUTPUT_TOKENS) if self.level >= Level.CAP_OUTPUT_TOKENS else requested

    def prompt_budget(self, budget: int, context: int) -> int:
        """From level 1 the prompt window shrinks to half the context (older turns are dropped
        first); `budget` is what the prompt could use otherwise (context - max_tokens)."""
        return min(budget, max(1, context // 2)) if self.level >= Level.SHRINK_CONTEXT else budget

    def admit(self, tier: Tier, policy: TierPolicy) -> None:
        """Raise :class:`Overloaded` (503 + Retry-After) if `tier` is shed at this level."""
        if self.level < Level.SHED_FREE_TIER:
            return
        orders = [policy.get(name).shed_order for name in policy.names()]
        lowest, highest = min(orders), max(orders)
        if tier.shed_order >= highest:
            return  # the last tier in the shed order (enterprise) is never shed by the ladder
        if self.level >= Level.ENTERPRISE_ONLY or tier.shed_order <= lowest:
            raise Overloaded(
                f"the service is degraded (level {int(self.level)}) and is not serving the {tier.name} tier "
                f"right now; retry later",
                retry_after=self.degradation.retry_after_s,
            )
