"""What the data plane reads from the control plane: the ladder's level and the tier policy.

Mounted by the control plane (control_plane/app.py) as ``GET /v1/state``; every gateway watches it
(data_plane/gateway/cluster_state.py).

    index = StateIndex()
    store.subscribe(index.bump)                      # every policy / ladder change wakes readers
    app.include_router(build_state_router(index, lambda: cluster_state_body(store, controller)))

    GET /v1/state?index=N&wait=S    blocking query, the same contract as /v1/registry/members:
                                    answers at once when the current index differs from N,
                                    otherwise when it changes or after S seconds.

    {"index": 7, "instance_id": "9f0c...", "state_id": "4be1...",
     "degradation": {"level": 3, "reason": "...", "pinned": true, "since": 1700000000.0,
                     "retry_after_s": 30},
     "tiers": {"tiers": {"free": {...}, "plus": {...}, "enterprise": {...}}}, "tiers_source": "admin"}

``tiers`` is null while the control plane holds only the built-in default policy (no
``--tiers-file``, nothing PUT through the admin API): each gateway then keeps its own
``--tiers-file`` or default. Once the control plane has a policy of its own, it wins everywhere.

``state_id`` names the state itself: a random id written once into the state dir (``state_id.json``) and
read back by every later control plane on that dir, so it stays across restarts; null without a state
dir. A control plane started by mistake on another state dir answers with another id, and every gateway
logs an ERROR and counts it (data_plane/gateway/cluster_state.py) instead of adopting the reset pin,
tiers and abuse actions with a mere "initial".

The index starts at 1 in each control-plane process, so a reader that last saw a larger
index (the control plane restarted) is answered at once, as is ``index=0``. Unauthenticated,
like the registry: it is read-only and carries no secrets; bind to loopback or a private net.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from control_plane.json_files import write_json_atomic

log = logging.getLogger(__name__)

INDEX_HEADER = "X-State-Index"
STATE_ID_FILE = "state_id.json"


def load_state_id(state_dir: Path | None) -> str | None:
    """The state dir's id: read from ``state_id.json``, or made and written there the first time (None
    without a state dir, or when it can be neither read nor written: logged)."""
    if state_dir is None:
        return None
    path = state_dir / STATE_ID_FILE
    try:
        state_id = json.loads(path.read_text(encoding="utf-8"))["state_id"]
        if isinstance(state_id, str) and state_id:
            return state_id
        log.error("%s holds no state id; writing a new one (gateways will report a state change)", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("cannot read %s (%s); writing a new state id (gateways will report a state change)", path, exc)
    state_id = uuid.uuid4().hex
    try:
        write_json_atomic(path, {"state_id": state_id})
    except OSError as exc:
        log.error("cannot write %s (%s): this control plane serves without a state id", path, exc)
        return None
    log.info("new state dir %s: state id %s", state_dir, state_id)
    return state_id


class StateIndex:
    """A change counter with blocking waits; one per control-plane process."""

    def __init__(self, max_wait_s: float = 60.0, state_id: str | None = None) -> None:
        self.instance_id = uuid.uuid4().hex
        self.state_id = state_id
        """The state dir's id (:func:`load_state_id`): the same across restarts on the same dir."""
        self._index = 1
        self._max_wait_s = max_wait_s
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def index(self) -> int:
        return self._index

    def bump(self) -> None:
        """Record a change and wake every waiter."""
        self._index += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._closed:
            self._changed.set()

    def close_waiters(self) -> None:
        """Answer every blocking query now, and later ones at once (server shutting down)."""
        self._closed = True
        self._changed.set()

    async def wait(self, index: int, wait_s: float) -> int:
        """Return the current index once it differs from `index`, or after `wait_s` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self._max_wait_s)
        while not self._closed and self._index == index:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self._index


class DegradationState(BaseModel):
    level: int = Field(ge=0, le=4, description="0 normal, 1 shrink context, 2 cap output, 3 shed free, 4 enterprise only")
    reason: str = Field(description="Why the level is what it is")
    pinned: bool = Field(description="True while an operator holds the level")
    since: float = Field(description="Unix time of the last change")
    retry_after_s: int = Field(description="Retry-After the gateway sends with requests it sheds")


class ClusterStateBody(BaseModel):
    """Body of ``GET /v1/state``."""

    index: int = Field(description="Change index; pass it back as ?index= to wait for the next change")
    instance_id: str = Field(description="Changes when the control plane restarts")
    state_id: str | None = Field(None, description="The id of the control plane's state dir: the same across "
                                 "restarts on it, another one for another dir; null without a state dir")
    degradation: DegradationState
    tiers: dict[str, Any] | None = Field(description="The tier policy, as TierPolicy.to_dict(); null while the "
                                         "control plane has only the built-in default (gateways keep their own)")
    tiers_source: str = Field(description="default | file | state | admin")


def cluster_state_body(index: StateIndex, store: Any, retry_after_s: float) -> dict[str, Any]:
    """The ``/v1/state`` body from a :class:`~control_plane.policy_store.PolicyStore`."""
    record = store.degradation
    return {
        "index": index.index,
        "instance_id": index.instance_id,
        "state_id": index.state_id,
        "degradation": {
            "level": record.level,
            "reason": record.reason,
            "pinned": record.pinned,
            "since": record.since,
            "retry_after_s": max(1, math.ceil(retry_after_s)),
        },
        "tiers": None if store.tiers_source == "default" else store.tiers.to_dict(),
        "tiers_source": store.tiers_source,
    }


def build_state_router(index: StateIndex, body: Callable[[], dict[str, Any]]) -> APIRouter:
    """``GET /v1/state`` over `index` (wait) and `body` (what to answer)."""
    router = APIRouter(prefix="/v1", tags=["state"])

    @router.get(
        "/state",
        response_model=ClusterStateBody,
        summary="Degradation level and tier policy (blocking query)",
        description="Answers at once when the state index differs from `index` (0 always), "
        "else when the state changes or after `wait` seconds. Used by every gateway.",
    )
    async def state(
        index_param: int = Query(default=0, ge=0, alias="index", description="last index seen"),
        wait: float = Query(default=5.0, ge=0.0, le=600.0, allow_inf_nan=False, description="seconds to wait"),
    ) -> JSONResponse:
        await index.wait(index_param, wait)
        data = body()
        return JSONResponse(data, headers={INDEX_HEADER: str(data["index"])})

    return router
