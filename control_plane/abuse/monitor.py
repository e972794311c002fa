"""The abuse monitor: every interval, the rules over the usage ledger and the gateways' reports;
findings become graduated, expiring actions the gateways apply (control_plane/abuse/api.py serves
them; data_plane/gateway/abuse.py applies them).

    monitor = AbuseMonitor(AbuseConfig(), ledger_store, AbuseMetrics(registry))
    await monitor.start()                          # the task `abuse-monitor`
    monitor.report_auth_failures({"10.0.0.7": 3})  # what a gateway posts
    await monitor.evaluate()                       # what the task does every config.interval_s
    monitor.active()                               # [Action, ...] in force
    monitor.lift(action_id, by="operator")         # or confirm(action_id)
    await monitor.aclose()

One action per (subject, rule): a finding with none starts the rule's ladder; a finding while an
action is in force moves it one step up the ladder once ``escalate_after_s`` has passed since the
step was taken, if the subject kept at it over that time (control_plane/abuse/rules.py
kept_at_it: a key that stopped stays at its step until it expires). Actions expire by themselves
(``durations_s``); a rule that still fires when its action expires takes the same step again (a key
that keeps hammering stays blocked; an address whose failures are still in the window stays banned).
A lift ends the action and lets the rule start afresh after one window (what it counted before the
lift no longer counts); a confirmation keeps the action ``confirm_hold_s``. Every change bumps the
state index that the gateways' blocking query waits on, so they apply it within a second or so.

With a state file (control_plane/abuse/persist.py: ``--state-dir``, sealed at rest) every change is
saved, and a restarted monitor is back where it was: the actions in force (those whose time ran
out meanwhile end as expired at once, the rest keep their expiry), the lifts' quiet windows, the
recent steps, the events and the gateways' reports as of the last change.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from control_plane.abuse.model import AbuseConfig, Action, Event, Finding, Response, Review, Rule, Subject
from control_plane.abuse.persist import AbuseStateFile
from control_plane.abuse.rules import evaluate, kept_at_it, tail_totals
from control_plane.state_api import StateIndex
from data_plane.common.tasks import stop_tasks
from data_plane.ledger.store import KeyActivity

log = logging.getLogger(__name__)

PERSISTED_EVENTS = 200
"""The newest events kept in the state file."""
MAX_REPORTED_ADDRESSES = 4096
"""Addresses kept per window from the gateways' reports (the most failing ones win)."""


class ActivitySource(Protocol):
    """What the monitor reads of the usage ledger (data_plane/ledger/store.py)."""

    def activity(self, start: float, end: float) -> list[KeyActivity]: ...


class AbuseMetrics:
    """``switchboard_abuse_*``: events by rule, actions in force by response, pending reviews."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("switchboard_abuse_events", "Abuse rules that fired (each a step on its ladder).",
                              ["rule", "response"], registry=registry)
        self.active = Gauge("switchboard_abuse_actions_active", "Abuse actions in force, by response.", ["response"],
                            registry=registry)
        self.pending = Gauge("switchboard_abuse_pending_review", "Actions in force no operator has confirmed yet.",
                             registry=registry)
        self.ended = Counter("switchboard_abuse_actions_ended", "Abuse actions ended, by how (expired|lifted).",
                             ["how"], registry=registry)
        self.evaluations = Counter("switchboard_abuse_evaluations", "Evaluations by result (ok|error).", ["result"],
                                   registry=registry)
        for rule in Rule:
            for response in rule.ladder:
                self.events.labels(rule.value, response.value)
        for response in Response:
            self.active.labels(response.value)
        for how in ("expired", "lifted"):
            self.ended.labels(how)


class AbuseMonitor:
    """See the module docstring."""

    def __init__(self, config: AbuseConfig, source: ActivitySource | None, metrics: AbuseMetrics, *,
                 index: StateIndex | None = None, clock: Callable[[], float] = time.time,
                 store: AbuseStateFile | None = None) -> None:
        self.config = config
        self.index = index or StateIndex()
        self._source = source
        self._metrics = metrics
        self._clock = clock
        self._actions: dict[tuple[Subject, str, Rule], Action] = {}
        self._events: collections.deque[Event] = collections.deque(maxlen=config.max_events)
        self._ended: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        self._suppressed: dict[tuple[Subject, str, Rule], float] = {}
        self._last_step: dict[tuple[Subject, str, Rule], tuple[Response, float]] = {}
        self._auth: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self._next_id = 1
        self._task: asyncio.Task[None] | None = None
        self._warned = False
        self._tail: dict[str, Any] = {}
        self._store = store
        saved = store.load() if store is not None else None
        if saved is not None:
            self._restore(saved)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="abuse-monitor")

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.evaluate()

    # -- inputs ---------------------------------------------------------------------------------

    def report_auth_failures(self, counts: dict[str, int]) -> None:
        """A gateway's authentication failures per source address since its last report."""
        if counts:
            self._auth.append((self._clock(), dict(counts)))

    def _auth_in_window(self, now: float) -> dict[str, int]:
        while self._auth and self._auth[0][0] < now - self.config.window_s:
            self._auth.popleft()
        total: collections.Counter[str] = collections.Counter()
        for _, counts in self._auth:
            total.update(counts)
        return dict(total.most_common(MAX_REPORTED_ADDRESSES))

    async def evaluate(self) -> list[Finding]:
        """One pass: read, apply the rules, step and expire the actions. Never raises."""
        now = self._clock()
        c = self.config
        try:
            recent: list[KeyActivity] = []
            baseline: list[KeyActivity] = []
            if self._source is not None:
                recent = await asyncio.to_thread(self._source.activity, now - c.window_s, now)
                baseline = await asyncio.to_thread(self._source.activity, now - c.window_s - c.baseline_s,
                                                   now - c.window_s)
                tail = await asyncio.to_thread(self._source.activity, now - min(c.escalate_after_s, c.window_s), now)
                self._tail = tail_totals(tail)
            findings = evaluate(c, recent, baseline, self._auth_in_window(now), baseline_end=now - c.window_s)
        except Exception as exc:  # noqa: BLE001 (a ledger that is down, any driver: keep what is in force)
            self._metrics.evaluations.labels("error").inc()
            if not self._warned:
                log.warning("abuse monitor: cannot read the usage ledger (%s: %s); actions in force stay",
                            type(exc).__name__, exc)
                self._warned = True
            # the gateways' reports do not need the ledger: address bans still apply
            findings = evaluate(c, [], [], self._auth_in_window(now))
        else:
            self._metrics.evaluations.labels("ok").inc()
            self._warned = False
        changed = self._expire(now) | self._apply(findings, now)
        if changed:
            self._changed()
        return findings

    # -- the ladder -----------------------------------------------------------------------------

    def _apply(self, findings: list[Finding], now: float) -> bool:
        changed = False
        for f in findings:
            key = (f.rule.subject, f.subject, f.rule)
            if self._suppressed.get(key, 0.0) > now:
                continue
            current = self._actions.get(key)
            ladder = f.rule.ladder
            if current is None:  # new, or back within a window of the last step expiring: that step again
                last = self._last_step.get(key)
                step = last[0] if last is not None and last[1] > now - self.config.window_s else ladder[0]
            else:
                at = ladder.index(current.response)
                if at + 1 >= len(ladder) or now - current.created_at < self.config.escalate_after_s:
                    continue
                if not kept_at_it(self.config, f, self._tail):
                    continue
                step = ladder[at + 1]
            self._take(f, step, now, current)
            changed = True
        return changed

    def _take(self, f: Finding, step: Response, now: float, previous: Action | None) -> None:
        action = Action(id=self._new_id(), subject_kind=f.rule.subject, subject=f.subject,
                        tenant=f.tenant or (previous.tenant if previous else ""), rule=f.rule, response=step,
                        reason=f.reason, created_at=now, expires_at=now + self.config.duration(step),
                        review=previous.review if previous else Review.PENDING)
        if previous is not None and previous.review is Review.CONFIRMED:
            action = replace(action, expires_at=max(action.expires_at, previous.expires_at))
        self._actions[(f.rule.subject, f.subject, f.rule)] = action
        self._events.append(Event(self._new_id(), now, f.rule, f.rule.subject, f.subject, action.tenant, f.reason,
                                  step))
        self._metrics.events.labels(f.rule.value, step.value).inc()
        log.warning("abuse: %s %s %s -> %s (%s)", f.rule.value, f.rule.subject.value, f.subject, step.value, f.reason)

    def _expire(self, now: float) -> bool:
        done = [k for k, a in self._actions.items() if a.expires_at <= now]
        for key in done:
            action = self._actions.pop(key)
            self._last_step[key] = (action.response, now)
            self._end(action, "expired", now)
        for key in [k for k, until in self._suppressed.items() if until <= now]:
            del self._suppressed[key]
        for key in [k for k, (_, at) in self._last_step.items() if at <= now - self.config.window_s]:
            del self._last_step[key]
        return bool(done)

    def _end(self, action: Action, how: str, now: float, by: str = "") -> None:
        self._ended.append({**action.to_dict(), "ended": how, "ended_at": now, "ended_by": by})
        self._metrics.ended.labels(how).inc()
        log.info("abuse: %s on %s %s %s (%s)", action.response.value, action.subject_kind.value, action.subject,
                 how, by or "its time")

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _changed(self) -> None:
        for response in Response:
            self._metrics.active.labels(response.value).set(
                sum(1 for a in self._actions.values() if a.response is response))
        self._metrics.pending.set(sum(1 for a in self._actions.values() if a.review is Review.PENDING))
        self.index.bump()
        if self._store is not None:
            self._store.save(self.snapshot())

    # -- at rest --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything a restarted monitor needs (ids, numbers, reasons: no text)."""
        def key(k: tuple[Subject, str, Rule]) -> list[str]:
            return [k[0].value, k[1], k[2].value]

        return {"next_id": self._next_id, "actions": [a.to_dict() for a in self._actions.values()],
                "suppressed": [[*key(k), until] for k, until in self._suppressed.items()],
                "last_step": [[*key(k), r.value, at] for k, (r, at) in self._last_step.items()],
                "events": [e.to_dict() for e in list(self._events)[-PERSISTED_EVENTS:]], "ended": list(self._ended),
                "auth": [[at, counts] for at, counts in self._auth]}

    def _restore(self, saved: dict[str, Any]) -> None:
        now = self._clock()
        try:
            actions = [Action.from_dict(a) for a in saved.get("actions", [])]
            suppressed = {(Subject(k), s, Rule(r)): float(u) for k, s, r, u in saved.get("suppressed", [])}
            last = {(Subject(k), s, Rule(r)): (Response(x), float(at)) for k, s, r, x, at in saved.get("last_step", [])}
            events = [Event.from_dict(e) for e in saved.get("events", [])]
            auth = [(float(at), {str(a): int(n) for a, n in counts.items()}) for at, counts in saved.get("auth", [])]
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            log.error("abuse state: saved state not understood (%s: %s); starting without it", type(exc).__name__, exc)
            return
        self._actions = {(a.subject_kind, a.subject, a.rule): a for a in actions}
        self._suppressed, self._last_step = suppressed, last
        self._events.extend(events)
        self._ended.extend(e for e in saved.get("ended", []) if isinstance(e, dict))
        self._auth.extend(auth)
        self._next_id = max([int(saved.get("next_id", 1)), *(a.id + 1 for a in actions), *(e.id + 1 for e in events)])
        expired = len([a for a in actions if a.expires_at <= now])
        log.info("abuse state restored: %d actions in force, %d whose time ran out while down", len(actions) - expired,
                 expired)
        self._expire(now)
        self._changed()

    # -- operators ------------------------------------------------------------------------------

    def _find(self, action_id: int) -> tuple[tuple[Subject, str, Rule], Action] | None:
        return next(((k, a) for k, a in self._actions.items() if a.id == action_id), None)

    def lift(self, action_id: int, by: str = "operator") -> Action | None:
        """End an action now; its rule counts afresh after one window. None if not in force."""
        found = self._find(action_id)
        if found is None:
            return None
        key, action = found
        now = self._clock()
        del self._actions[key]
        self._suppressed[key] = now + self.config.window_s
        self._end(action, "lifted", now, by)
        self._changed()
        return action

    def confirm(self, action_id: int) -> Action | None:
        """An operator agrees: the action is held ``confirm_hold_s`` from now. None if not in force."""
        found = self._find(action_id)
        if found is None:
            return None
        key, action = found
        held = replace(action, review=Review.CONFIRMED,
                       expires_at=max(action.expires_at, self._clock() + self.config.confirm_hold_s))
        self._actions[key] = held
        log.info("abuse: %s on %s %s confirmed", held.response.value, held.subject_kind.value, held.subject)
        self._changed()
        return held

    # -- views ----------------------------------------------------------------------------------

    def active(self) -> list[Action]:
        return sorted(self._actions.values(), key=lambda a: a.id)

    def events(self) -> list[Event]:
        return list(self._events)

    def ended(self) -> list[dict[str, Any]]:
        return list(self._ended)

    def state_body(self) -> dict[str, Any]:
        """What the gateways watch (``GET /v1/abuse/state``): the actions that change traffic."""
        return {"index": self.index.index, "instance_id": self.index.instance_id,
                "throttle_rpm": self.config.throttle_rpm,
                "strict_max_output_tokens": self.config.strict_max_output_tokens,
                "actions": [a.to_dict() for a in self.active() if a.response is not Response.FLAG]}


__all__ = ["MAX_REPORTED_ADDRESSES", "AbuseMetrics", "AbuseMonitor", "ActivitySource"]
