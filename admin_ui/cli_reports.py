"""`switchboard admin usage` and `switchboard admin abuse`: the console's Usage and Abuse pages from a shell.

    switchboard admin usage                                 # the last 7 days per day, tenant and tier
    switchboard admin usage --since 24h --bucket hour --tenant acme
    switchboard admin usage --by key_id --key 3f0a1b2c4d5e  # one key's requests and tokens (revoked keys too)
    switchboard admin usage --csv > usage.csv               # the same rows as CSV (GET ...&format=csv)
    switchboard admin abuse                                 # the actions in force: what the gateways do now
    switchboard admin abuse --events 20                     # and the monitor's latest events, newest first
    switchboard admin abuse lift 7                          # end action 7 now
    switchboard admin abuse confirm 7                       # keep it in force for the review hold

Both read the same admin routes as the console (GET /admin/v1/usage, GET /admin/v1/abuse, POST
/admin/v1/abuse/actions/{id}/lift|confirm) through admin_ui.client.AdminClient; admin_ui/cli.py turns
each failure into one line and exit 1.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from admin_ui.client import AdminClient
from admin_ui.views.abuse import action_rows, ended_rows, event_rows
from data_plane.ledger.store import GROUP_FIELDS, SUMS

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
USAGE_HEADS = {"requests": "REQUESTS", "errors": "ERRORS", "prompt_tokens": "PROMPT", "cached_tokens": "CACHED",
               "completion_tokens": "COMPLETION"}


def _duration(text: str) -> float:
    """How far back: a number with an optional unit (90s, 30m, 24h, 7d; bare: seconds), more than 0."""
    m = _DURATION.match(text)
    if not m or not float(m.group(1)) > 0:
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m, 24h or 7d, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _when(text: str) -> float:
    """A moment: unix seconds, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected unix seconds or an ISO 8601 time "
                                         f"(2026-12-05 or 2026-12-05T18:00Z), got {text!r}") from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def _group(text: str) -> str:
    fields = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in fields if f not in GROUP_FIELDS]
    if bad or not fields:
        raise argparse.ArgumentTypeError(f"group by one or more of {', '.join(GROUP_FIELDS)} "
                                         f"(comma-separated), got {text!r}")
    return ",".join(fields)


def _row_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100000:
        raise argparse.ArgumentTypeError(f"must be 1 to 100000, got {value}")
    return value


def _events(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be 0 to 1000, got {value}")
    return value


def _action_id(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"an action id is a whole number (as `switchboard admin abuse` lists "
                                         f"it), got {text!r}")
    return int(text)


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("usage", parents=[common],
                       help="requests and tokens from the usage ledger, per time bucket, tenant and tier")
    p.add_argument("--since", type=_duration, default=None, metavar="DURATION",
                   help="from this long ago until --end (30m, 24h, 7d; default 7d)")
    p.add_argument("--start", type=_when, default=None, metavar="TIME",
                   help="from this moment: unix seconds or ISO 8601, UTC unless it says (instead of --since)")
    p.add_argument("--end", type=_when, default=None, metavar="TIME", help="until this moment (default: now)")
    p.add_argument("--bucket", choices=("hour", "day", "none"), default="day",
                   help="the time bucket (default day; none: one row per group)")
    p.add_argument("--by", type=_group, default="tenant,tier",
                   help=f"group rows by these, comma-separated: {', '.join(GROUP_FIELDS)} (default tenant,tier)")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--key", default=None, metavar="KEY_ID",
                   help="only this key id (as `switchboard keys list` shows it; a revoked key's too)")
    p.add_argument("--tier", default=None, help="only this tier ('unknown': requests refused before their key)")
    p.add_argument("--model", default=None, help="only this model")
    p.add_argument("--limit", type=_row_limit, default=None, metavar="N",
                   help="at most N rows, the newest buckets kept (1 to 100000; default the API's 10000)")
    p.add_argument("--csv", action="store_true", help="the rows as CSV (with ISO 8601 times), for a spreadsheet")
    p.set_defaults(usage_parser=p)
    p = sub.add_parser("abuse", parents=[common],
                       help="the abuse monitor's actions in force; or lift/confirm one: abuse lift|confirm ID")
    p.add_argument("action", nargs="?", choices=("lift", "confirm"), help="end an action now, or confirm it")
    p.add_argument("action_id", nargs="?", type=_action_id, metavar="ID", help="the action's id (as listed)")
    p.add_argument("--events", type=_events, default=0, metavar="N",
                   help="also the monitor's latest N events, newest first (0 to 1000)")
    p.add_argument("--ended", action="store_true", help="also the actions that ended (expired or lifted)")
    p.add_argument("--by", default="switchboard admin", help="who lifts it, kept in the history (with lift)")
    p.set_defaults(abuse_parser=p)


def check(args: argparse.Namespace) -> None:
    """Usage errors that argparse cannot see alone (exit 2 with the subcommand's usage line)."""
    if args.command == "usage":
        if args.since is not None and args.start is not None:
            args.usage_parser.error("give --since or --start, not both")
        if args.csv and args.json:
            args.usage_parser.error("give --csv or --json, not both")
    if args.command == "abuse" and (args.action is None) != (args.action_id is None):
        args.abuse_parser.error("lift and confirm take an action ID: abuse lift ID (the ids are in the list)")


def usage_filters(args: argparse.Namespace, now: float | None = None) -> dict[str, Any]:
    end = args.end if args.end is not None else (time.time() if now is None else now)
    start = args.start if args.start is not None else (end - args.since if args.since is not None else None)
    return {"tenant": args.tenant, "key": args.key, "tier": args.tier, "model": args.model, "start": start,
            "end": end, "group_by": args.bucket, "by": args.by, "limit": args.limit}


def run_usage(args: argparse.Namespace, admin: AdminClient) -> str:
    filters = usage_filters(args)
    if args.csv:
        return admin.usage_csv(**filters).rstrip("\n")
    body = admin.usage(**filters)
    if args.json:
        import json

        return json.dumps(body, indent=2)
    return format_usage(body)


def format_usage(body: dict[str, Any]) -> str:
    """One line per bucket and group (UTC times), a totals line, and a warning when `limit` cut rows."""
    by = [str(f) for f in body.get("by") or []]
    bucket = body.get("bucket")
    rows: list[tuple[str, ...]] = [("START (UTC)", *(f.upper().replace("_", " ") for f in by),
                                    *USAGE_HEADS.values())]
    for r in body.get("rows") or []:
        start = "-" if bucket == "none" else _utc(r.get("start"), "%Y-%m-%d" if bucket == "day" else "%Y-%m-%d %H:%M")
        rows.append((start, *(str(r.get(f) or ("(no valid key)" if f == "tenant" else "-")) for f in by),
                     *(f"{int(r.get(s) or 0):,}" for s in SUMS)))
    totals = body.get("totals") or {}
    span = f"{_utc(body.get('start'), '%Y-%m-%d %H:%M')} to {_utc(body.get('end'), '%Y-%m-%d %H:%M')} UTC"
    total = "total: " + ", ".join(f"{int(totals.get(s) or 0):,} {s.replace('_', ' ')}" for s in SUMS)
    if len(rows) == 1:
        lines = [f"no usage recorded from {span}"]
    else:
        lines = [_table(rows, right=len(rows[0]) - len(SUMS)), "", f"{span}; {total}"]
    if body.get("truncated"):
        lines.append("truncated: more rows than --limit; the newest buckets are shown, the totals cover the whole "
                     "range (narrow --since, filter, or use --bucket day)")
    return "\n".join(lines)


def run_abuse(args: argparse.Namespace, admin: AdminClient) -> str:
    import json

    if args.action == "lift":
        body = admin.lift_abuse(args.action_id, by=args.by)
        return json.dumps(body, indent=2) if args.json else _done("lifted", body.get("lifted") or {})
    if args.action == "confirm":
        body = admin.confirm_abuse(args.action_id)
        return json.dumps(body, indent=2) if args.json else _done("confirmed", body.get("confirmed") or {})
    body = admin.abuse(events=args.events)
    return json.dumps(body, indent=2) if args.json else format_abuse(body, ended=args.ended)


def _done(verb: str, action: dict[str, Any]) -> str:
    return (f"{verb} action {action.get('id')}: {action.get('response')} on {action.get('subject_kind')} "
            f"{action.get('subject')} ({str(action.get('rule', '')).replace('_', ' ')})")


def format_abuse(body: dict[str, Any], *, ended: bool = False, now: float | None = None) -> str:
    """The actions in force, the strongest first, each with what the gateways do under it; then, if asked,
    the ended actions and the events (the API sends as many events as --events asked for)."""
    now = time.time() if now is None else now
    actions = action_rows(body.get("actions") or [], now=now, config=body.get("config") or {})
    rows = [("ID", "RESPONSE", "SUBJECT", "TENANT", "RULE", "SINCE", "EXPIRES", "REVIEW", "WHY")]
    rows += [(str(a["id"]), a["response"], a["subject"], str(a["tenant"]), a["rule"], a["since"], a["expires"],
              a["review"], a["why"]) for a in actions]
    lines = [_table(rows) if actions else "no abuse actions in force"]
    for response in sorted({a["response"] for a in actions}):
        lines.append(f"  {response}: {next(a['effect'] for a in actions if a['response'] == response)}")
    if ended:
        done = ended_rows(body.get("ended") or [])
        lines += ["", "ended:" if done else "no ended actions"]
        if done:
            lines.append(_table([("RESPONSE", "SUBJECT", "RULE", "ENDED", "AT"),
                                 *((d["response"], d["subject"], d["rule"], d["ended"], d["at"]) for d in done)]))
    events = event_rows(body.get("events") or [])
    if events:
        lines += ["", "events, newest first:",
                  _table([("AT", "RULE", "SUBJECT", "STEP", "WHY"),
                          *((e["at"], e["rule"], e["subject"], e["step"], e["why"]) for e in events)])]
    return "\n".join(lines)


def _utc(ts: object, fmt: str) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return datetime.fromtimestamp(ts, tz=UTC).strftime(fmt)


def _table(rows: Sequence[tuple[str, ...]], right: int | None = None) -> str:
    """Columns padded to their widest cell, the last one unpadded; columns from `right` on aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if right is not None and i >= right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


__all__ = ["add_parsers", "check", "format_abuse", "format_usage", "run_abuse", "run_usage", "usage_filters"]
