"""`switchboard admin`: the operator's actions from a shell, over the same admin API as the console.

    switchboard admin status                       # members, degradation level, firing alerts
    switchboard admin members --json               # GET /admin/v1/members, as JSON
    switchboard admin processes                    # what `up` supervises: pids, up since, restarts, last exit
    switchboard admin decisions [--all]            # the autoscaler's decisions with their reasons (scalings)
    switchboard admin drain shard-1                # stop routing to a member (in-flight work finishes)
    switchboard admin undrain shard-1
    switchboard admin degrade 3 --reason "incident 4711"   # pin a degradation level
    switchboard admin degrade --release                     # let the automatic rule decide again
    switchboard admin tiers                        # the tier policy in force: limits per tier
    switchboard admin tiers free rpm=30 tpm=10000  # change a tier's fields (gateways apply it within ~1 s)
    switchboard admin usage --since 24h --bucket hour   # the usage ledger per tenant and tier (--csv, --json)
    switchboard admin abuse [--events 20]          # abuse actions in force; `abuse lift ID`, `abuse confirm ID`

Why: the runbook's steps (docs/runbook.md: drain the outlier, release a pin) were raw ``curl`` calls
with a bearer token pasted by hand, and an operator without a browser on the console's network had
no other way. Every command finds the control plane and its token as the console does
(``--control-plane-url`` / ``SWITCHBOARD_CONTROL_PLANE_URL``, else the ``control_plane_url`` that
``switchboard up`` records in its credentials file; ``SWITCHBOARD_ADMIN_TOKEN``, else the
``admin_token`` in ``--credentials-file``, which ``switchboard up`` writes) and goes through
:class:`admin_ui.client.AdminClient`, so a failure is one line naming what to fix, never a traceback.

Exit codes: 0 done; 1 the control plane is unreachable, refused the token, or refused the action
(an unknown member, a bad level); 2 a usage error (argparse's own).
"""

from __future__ import annotations

import argparse
import json
import signal
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from admin_ui import cli_reports
from admin_ui.client import AdminClient, ConsoleError, NotAvailable, Unauthorized, Unreachable
from admin_ui.settings import DEFAULT_CREDENTIALS_FILE, ENV_ADMIN_TOKEN, ConsoleSettings
from data_plane.common.tls import add_tls_flags

PROG = "switchboard admin"


def _seconds(text: str) -> float:
    """A timeout: a positive number (0 or less reached httpx's socket layer as a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _limit(text: str) -> int:
    """How many decisions: 1 to 1000, as GET /admin/v1/decisions takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be 1 to 1000, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--control-plane-url", default=None,
                        help="the control plane (env SWITCHBOARD_CONTROL_PLANE_URL; default: the one `switchboard up` "
                             "recorded in the credentials file, with that file's token; else http://127.0.0.1:8300)")
    common.add_argument("--credentials-file", default=None,
                        help=f"where the admin token is when {ENV_ADMIN_TOKEN} is unset "
                             f"(env SWITCHBOARD_CREDENTIALS_FILE; default {DEFAULT_CREDENTIALS_FILE})")
    common.add_argument("--timeout-s", type=_seconds, default=5.0, help="timeout of one call (default 5)")
    common.add_argument("--json", action="store_true", help="print the control plane's answer as JSON")
    add_tls_flags(common, ("--ca-bundle",))  # a client: the CA of an https control plane
    parser = argparse.ArgumentParser(prog=PROG, description="Operator actions over the control plane's admin API.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", parents=[common], help="members, degradation level and firing alerts at a glance")
    sub.add_parser("members", parents=[common], help="every registered process and its status")
    sub.add_parser("processes", parents=[common],
                   help="the processes `switchboard up` supervises: pid, up since, restarts, last exit")
    p = sub.add_parser("decisions", parents=[common],
                       help="the autoscaler's decision log, oldest first: each scaling (and the latest tick) and why")
    p.add_argument("--limit", type=_limit, default=100, metavar="N",
                   help="the last N decisions the control plane kept (1 to 1000; default 100)")
    p.add_argument("--all", action="store_true", help="every tick, the holds and steadies too")
    for name, what in (("drain", "stop routing new requests to a member"), ("undrain", "put a member back")):
        p = sub.add_parser(name, parents=[common], help=what)
        p.add_argument("member", help="member id, as `switchboard admin members` lists it (e.g. shard-1)")
    p = sub.add_parser("degrade", parents=[common], help="pin a degradation level, or --release the pin")
    parser.set_defaults(degrade_parser=p)  # its own usage line in its errors
    p.add_argument("level", nargs="?", type=int, choices=range(5), help="0 normal ... 4 enterprise only")
    p.add_argument("--reason", default="", help="why (kept in the level's history; required with a level)")
    p.add_argument("--release", action="store_true", help="release the operator's pin")
    p = sub.add_parser("tiers", parents=[common],
                       help="the tier policy in force, or change one tier's limits: tiers TIER FIELD=VALUE ...")
    parser.set_defaults(tiers_parser=p)
    p.add_argument("tier", nargs="?", help="the tier to change (as `switchboard admin tiers` lists it)")
    p.add_argument("changes", nargs="*", metavar="FIELD=VALUE",
                   help=f"new values: {', '.join(TIER_FIELDS)} (whole numbers) or safety=POLICY")
    cli_reports.add_parsers(sub, common)
    return parser


TIER_FIELDS = ("priority", "rpm", "tpm", "max_context_tokens", "max_output_tokens", "replication", "shed_order")
"""A tier's numeric fields (data_plane/tiers.py Tier), in the order the table shows them."""


def _tier_changes(parser: argparse.ArgumentParser, changes: list[str]) -> dict[str, Any]:
    """FIELD=VALUE words as the fields of a tier, or a usage error naming the bad one."""
    out: dict[str, Any] = {}
    for change in changes:
        name, eq, value = change.partition("=")
        if not eq or name not in (*TIER_FIELDS, "safety"):
            parser.error(f"{change!r} is not FIELD=VALUE with FIELD one of {', '.join(TIER_FIELDS)}, safety")
        if name == "safety":
            out[name] = value
            continue
        try:
            out[name] = int(value)
        except ValueError:
            parser.error(f"{name} must be a whole number, got {value!r}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "degrade":
        if args.release == (args.level is not None):
            args.degrade_parser.error("takes a LEVEL (with --reason) or --release")
        if args.level is not None and not args.reason.strip():
            args.degrade_parser.error("a LEVEL needs --reason (it is kept in the history)")
    if args.command == "tiers":
        if args.tier is not None and not args.changes:
            args.tiers_parser.error(f"say what to change in {args.tier!r}: FIELD=VALUE (e.g. rpm=60)")
        args.tier_changes = _tier_changes(args.tiers_parser, args.changes)
    cli_reports.check(args)
    overrides = {k: v for k, v in (("control_plane_url", args.control_plane_url),
                                   ("credentials_file", args.credentials_file)) if v is not None}
    settings = ConsoleSettings(**overrides)
    verify: ssl.SSLContext | bool = True
    if ("control_plane_url" not in settings.model_fields_set and settings.admin_token is None
            and (url := settings.credentials().get("control_plane_url"))):
        # where `up` served, from its folder, with the token the same file holds: a token from the
        # environment never goes to a URL that a file in the working folder named
        settings = ConsoleSettings(**overrides, control_plane_url=str(url))
        ca = Path(settings.credentials_file).parent / "tls" / "ca.pem"  # `up --tls`'s CA, beside that file
        if str(url).startswith("https://") and ca.is_file():
            verify = ssl.create_default_context(cafile=str(ca))  # up's CA first: another CA of the same name
            verify.load_default_certs()  # (SSL_CERT_FILE, --ca-bundle) loaded before it was tried instead
    admin = AdminClient(settings.control_plane_url, settings.admin_token_value(), timeout_s=args.timeout_s,
                        verify=verify)
    try:
        run(args, admin)
    except Unauthorized as exc:
        where = Path(settings.credentials_file)
        source = (f"from {ENV_ADMIN_TOKEN}" if settings.admin_token is not None
                  else f"from {where}" if admin.has_token
                  else f"none: {ENV_ADMIN_TOKEN} is unset and {where} holds none" if where.exists()
                  else f"none: {ENV_ADMIN_TOKEN} is unset and there is no {where.resolve()} (run this where "
                       f"`switchboard up` ran, set SWITCHBOARD_UP_STATE_DIR to its --state-dir, or pass "
                       f"--credentials-file)")
        raise SystemExit(f"{PROG}: the control plane at {settings.control_plane_url} refused the admin token "
                         f"({exc.message}); token {source}") from None
    except Unreachable as exc:
        tls = " and, for https, --ca-bundle (the CA that signed its certificate)" if (
            settings.control_plane_url.startswith("https://")) else ""
        unused = settings.credentials().get("control_plane_url") if (
            settings.admin_token is not None and "control_plane_url" not in settings.model_fields_set) else None
        why = (f" ({ENV_ADMIN_TOKEN} is set, so the control plane {unused} that {settings.credentials_file} names "
               f"is not used: an environment token never goes to a URL a file names; pass it as --control-plane-url "
               f"or unset {ENV_ADMIN_TOKEN})") if unused and unused != settings.control_plane_url else ""
        raise SystemExit(f"{PROG}: {exc.message}; check --control-plane-url{tls}{why}") from None
    except NotAvailable as exc:
        raise SystemExit(f"{PROG}: {exc.message}") from None
    except ConsoleError as exc:
        raise SystemExit(f"{PROG}: the control plane answered {exc.status}: {exc.message}") from None
    finally:
        admin.close()


def run(args: argparse.Namespace, admin: AdminClient) -> None:
    actions: dict[str, Callable[[], Any]] = {
        "members": admin.members,
        "processes": admin.processes,
        "decisions": lambda: admin.decisions(args.limit),
        "drain": lambda: admin.drain(args.member),
        "undrain": lambda: admin.undrain(args.member),
        "degrade": lambda: admin.release_degradation() if args.release
        else admin.pin_degradation(args.level, args.reason),
    }
    if args.command in ("usage", "abuse"):
        print((cli_reports.run_usage if args.command == "usage" else cli_reports.run_abuse)(args, admin))
        return
    if args.command == "tiers":
        body = set_tier(admin, args.tier, args.tier_changes) if args.tier is not None else admin.tiers()
        print(json.dumps(body, indent=2) if args.json else format_tiers(body))
        return
    if args.command == "status":
        body = {"members": admin.members(), "degradation": admin.degradation(), "alerts": _alerts(admin),
                "processes": _processes(admin)}
        print(json.dumps(body, indent=2) if args.json else format_status(body))
        return
    body = actions[args.command]()
    if args.json:
        print(json.dumps(body, indent=2))
    elif args.command == "members":
        print(format_members(body.get("members") or []))
    elif args.command == "processes":
        print(format_processes(body) if body.get("supervisor") else
              "no process table: this control plane was not started by `switchboard up`")
    elif args.command == "decisions":
        print(format_decisions(body, every_tick=args.all) if body.get("autoscaler") else
              "no autoscaler: this control plane was started without --autoscale")
    elif args.command == "degrade":
        print(f"degradation level {body.get('level')} ({body.get('name', '')}): "
              + (str(body.get("reason", "")) if body.get("pinned") else "automatic (the pin is released)"))
    else:
        member = body.get("id", args.member)
        print(f"{member}: {body.get('status')}")
        if args.command == "drain" and body.get("status") == "draining":
            print(f"{PROG}: {member} stays drained until `{PROG} undrain {member}` or until it stops cleanly "
                  "(SIGTERM, `switchboard up` stopped): then it deregisters and comes back undrained; a crash or a "
                  "kill -9 keeps the drain", file=sys.stderr)


def set_tier(admin: AdminClient, name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """The policy in force with `changes` made to tier `name`, put back (the control plane validates it)."""
    tiers = dict(admin.tiers().get("tiers") or {})
    if name not in tiers:
        raise SystemExit(f"{PROG}: there is no tier {name!r} (the tiers are {', '.join(tiers) or 'none'}); add one "
                         "on the console's Traffic & tiers page or with PUT /admin/v1/tiers")
    tiers[name] = {**tiers[name], **changes}
    return admin.put_tiers({"tiers": tiers})


def format_tiers(body: dict[str, Any]) -> str:
    """One line per tier: its priority, limits, replicas, shed order and safety policy; then where the policy
    came from."""
    rows: list[tuple[str, ...]] = [
        ("TIER", "PRIORITY", "RPM", "TPM", "MAX CONTEXT", "MAX OUTPUT", "REPLICAS", "SHED ORDER", "SAFETY")]
    for name, t in (body.get("tiers") or {}).items():
        rows.append((str(name), *(str(t.get(f, "-")) for f in TIER_FIELDS), str(t.get("safety", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)
    at = body.get("updated_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, int | float) else "-"
    return f"{table}\n\nsource: {body.get('source', '-')}, updated {when}"


def _alerts(admin: AdminClient) -> dict[str, Any] | None:
    try:
        return admin.alerts()
    except NotAvailable:
        return None


def _processes(admin: AdminClient) -> dict[str, Any] | None:
    try:
        return admin.processes()
    except NotAvailable:  # a control plane from before the process table
        return None


def _exit(code: object) -> str:
    if not isinstance(code, int):
        return "-"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _why(process: dict[str, Any]) -> str:
    """The supervisor's reason, in parentheses, when it killed the process itself (a hang): a bare SIGKILL
    reads as the OOM killer's or a person's."""
    reason = process.get("last_exit_reason")
    return f" ({reason})" if isinstance(reason, str) and reason else ""


def format_processes(body: dict[str, Any], now: float | None = None) -> str:
    """One line per process `up` supervises: pid, how long up, restarts, how and when it last died."""
    now = time.time() if now is None else now

    def ago(t: object) -> str:
        if not isinstance(t, int | float) or not t:
            return "-"
        return f"{time.strftime('%H:%M:%S', time.localtime(t))} ({_age(now - t)} ago)"

    rows = [("PROCESS", "PID", "STATE", "UP SINCE", "RESTARTS", "LAST EXIT")]
    for p in body.get("processes") or []:
        last = p.get("last_exit_at")
        rows.append((str(p.get("name")), str(p.get("pid") or "-"), "running" if p.get("running") else "down",
                     ago(p.get("started_at")) if p.get("running") else "-", str(p.get("restarts", 0)),
                     f"{_exit(p.get('last_exit_code'))}{_why(p)} at {ago(last)}" if last else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def format_members(members: list[dict[str, Any]], now: float | None = None) -> str:
    """One line per member: id, service, zone, status, heartbeat age, URL."""
    now = time.time() if now is None else now
    rows = [("MEMBER", "SERVICE", "ZONE", "STATUS", "HEARTBEAT", "URL")]
    for m in sorted(members, key=lambda m: (str(m.get("service")), str(m.get("id")))):
        beat = m.get("last_heartbeat")
        age = f"{max(0.0, now - float(beat)):.1f} s ago" if isinstance(beat, int | float) else "-"
        rows.append((str(m.get("id")), str(m.get("service")), str(m.get("zone") or "-"), str(m.get("status")),
                     age, str(m.get("url"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def format_decisions(body: dict[str, Any], *, every_tick: bool = False) -> str:
    """One line per decision, oldest first: when (and how many ticks it repeated), action, replicas, code,
    outcome, then its reason. Without `every_tick`, the holds and steadies are left out but the latest
    decision, as the console's Autoscaler page does."""
    decisions = list(body.get("decisions") or [])
    shown = decisions if every_tick else [d for d in decisions[:-1] if d.get("action") not in ("hold", "steady")]
    if not every_tick and decisions:
        shown.append(decisions[-1])
    rows = [("TIME", "ACTION", "REPLICAS", "CODE", "OUTCOME", "REASON")]
    for d in shown:
        at, last = d.get("at"), d.get("last_at")
        when = time.strftime("%H:%M:%S", time.localtime(at)) if isinstance(at, int | float) else "-"
        if isinstance(last, int | float) and isinstance(at, int | float) and int(d.get("repeats") or 1) > 1:
            when += f"-{time.strftime('%H:%M:%S', time.localtime(last))} x{d.get('repeats')}"
        frm, to = d.get("from"), d.get("to")
        rows.append((when, str(d.get("action", "?")), f"{frm}" if frm == to else f"{frm} -> {to}",
                     str(d.get("code") or "-"), str(d.get("outcome") or "-"), str(d.get("reason", ""))))
    if len(rows) == 1:
        return "no decisions yet"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def format_status(body: dict[str, Any], now: float | None = None) -> str:
    members = (body.get("members") or {}).get("members") or []
    lines = []
    for service in ("shard", "cache", "gateway"):
        of = [m for m in members if m.get("service") == service]
        passing = sum(1 for m in of if m.get("status") == "passing")
        others = sorted({str(m.get("status")) for m in of} - {"passing"})
        detail = ", ".join(f"{sum(1 for m in of if m.get('status') == s)} {s}" for s in others)
        lines.append(f"{service + 's':<9} {passing}/{len(of)} passing" + (f" ({detail})" if detail else ""))
    d = body.get("degradation") or {}
    lines.append(f"{'level':<9} L{d.get('level', '?')} {d.get('name', '')}"
                 + (f" ({d.get('reason', '')})" if d.get("pinned") else ""))
    alerts = body.get("alerts")
    if alerts is not None:
        firing = [a for a in alerts.get("alerts") or [] if a.get("state") == "firing"]
        names = ", ".join(str(a.get("name")) for a in firing)
        lines.append(f"{'alerts':<9} {len(firing)} firing" + (f": {names}" if names else ""))
    table = body.get("processes")
    restarted = [p for p in (table or {}).get("processes") or [] if p.get("restarts") or not p.get("running")]
    if table and table.get("supervisor"):
        lines.append(f"{'restarts':<9} " + (", ".join(f"{p.get('name')} x{p.get('restarts')}" + ("" if p.get("running") else " (down)")
                                                     for p in restarted)
                                           + "  (`switchboard admin processes`)" if restarted else "none"))
    return "\n".join(lines) + "\n\n" + format_members(members, now)


if __name__ == "__main__":
    main(sys.argv[1:])
