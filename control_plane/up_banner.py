"""What `switchboard up` prints once everything is healthy: URLs, dev keys, admin token, the console's login.

    banner(s, creds, cp, caches, shards, gateways, state, stages, console_login)   # control_plane/launcher.py

Secrets only on a terminal. The dev API keys and the admin token (each on the run that made it) and the
console's one-time login link (``/?token=CODE``, live until used or the console restarts) are printed in
full only when stdout is a TTY, as `switchboard console` prints its link (admin_ui/launch.py). `up >
up.log`, a CI job's output or ``nohup`` would otherwise keep them in a file anyone may read (umask
022: mode 644). Elsewhere the banner is the same but says where each secret is: the keys and the admin
token in ``credentials.json`` (mode 600), the login link in ``STATE/console_login`` (mode 600, written
here for that run, removed when `up` starts and stops: a link of an earlier run is dead anyway). A console
that `up` restarts gets a fresh code, and its link reaches the operator the same way (`new_console_login`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

from control_plane.dev_credentials import key_id
from control_plane.supervisor import Child
from control_plane.up_settings import UpSettings
from data_plane.common.tls import TlsConfig, is_loopback
from data_plane.membership.placement import DEFAULT_ZONE

LOGIN_LINK_FILE = "console_login"
"""In the state dir: the console's one-time login link, when stdout is not a terminal (mode 600)."""
NOT_A_TERMINAL = "not printed: stdout is not a terminal"


def console_host(s: UpSettings, tls: bool) -> str:
    """Where the console listens (and Prometheus, as tls=False: no auth, and it serves the tenants' series): `--host`,
    except a network address without TLS, where the admin token typed into its login would cross it: loopback."""
    return s.host if tls or is_loopback(s.host) else "127.0.0.1"


def save_login_link(state: Path, link: str) -> Path:
    """`link` in ``state/console_login``, mode 600 from its first byte, whole or not at all (a temporary
    file renamed over it)."""
    path = state / LOGIN_LINK_FILE
    tmp = state / f".{LOGIN_LINK_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(link + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def forget_login_link(state: Path) -> None:
    """Remove the login link file: an earlier run's link (or this run's, once it stops) logs nobody in."""
    with contextlib.suppress(OSError):
        (state / LOGIN_LINK_FILE).unlink()


def new_console_login(state: Path, link: str, tty: bool) -> None:
    """A restarted console's fresh one-time login link, to the operator the way the banner gave the first one:
    in full on a terminal, else rewritten into ``state/console_login`` (mode 600). The earlier link is dead:
    the restarted console knows only its new code."""
    if tty:
        print(f"[switchboard] console restarted: its new one-time login link is {link} (the earlier one no "
              "longer works; or log in with the admin token)", flush=True)
        return
    path = save_login_link(state, link)
    print(f"[switchboard] console restarted: its new one-time login link is in {path} (mode 600; {NOT_A_TERMINAL}; "
          "the earlier one no longer works)", flush=True)


def _host_cap(s: UpSettings, cp: Child) -> str:
    """The local actuator's cap when it is below --max-replicas (torch shards past the cores: launcher.py
    local_max_shards), so the operator hears it at start, not first from a `capped` scale-out."""
    if "--local-max-shards" not in cp.args:
        return ""
    cap = int(cp.args[cp.args.index("--local-max-shards") + 1])
    return f"; this host holds {cap} (--local-max-shards: its cores / threads per shard)" if cap < s.max_replicas else ""


def banner(s: UpSettings, creds: dict, cp: Child, caches: list[Child], shards: list[Child],
           gateways: list[Child], state: Path, stages: dict[str, str] | None = None,
           console_login: str | None = None, *, tty: bool | None = None) -> None:
    """Print the banner; `stages`: each pipelined shard's stages (stage@host:layers); `console_login`: the
    console's one-time login link (never in a log); `tty`: whether secrets may be printed (default: whether
    stdout is a terminal)."""
    tty = sys.stdout.isatty() if tty is None else tty
    stages = stages or {}
    keys = creds["keys"]
    tier = "plus" if "plus" in keys else next(iter(keys), None)
    gateway, zones, model = gateways[0], s.zones or [DEFAULT_ZONE], "synthetic" if s.engine == "synthetic" else None
    ca = f" --cacert {os.environ['SSL_CERT_FILE']}" if gateway.url.startswith("https") and "SSL_CERT_FILE" in os.environ else ""
    login_file = save_login_link(state, console_login) if console_login and not tty else None
    lines = [
        "",
        "Switchboard is up.",
        "",
        f"  chat API (OpenAI-compatible)  {gateway.url}/v1" + (f"   (zone {zones[0]})" if s.zones else ""),
        *[f"  chat API, zone {zone:<14}  {g.url}/v1" for zone, g in zip(zones[1:], gateways[1:])],
        f"  control plane / admin API     {cp.url}   (admin token below)",
        *console_lines(s, console_login, login_file),
        *[f"  {c.name:<28}  {c.url}" + (f"   (zone {c.args[c.args.index('--zone') + 1]})" if s.zones else "")
          + (f"   stages {stages[c.name].replace(',', ' ')}  (stage@host:layers)" if c.name in stages else "")
          for c in shards + caches],
        *([f"  shards                        autoscaled, {s.min_replicas}..{s.max_replicas} (console: Autoscaler)"
           + _host_cap(s, cp)] if s.autoscale else []),
        *([f"  prometheus                    {console_host(s, False)}:{s.prometheus_port}  (alerts: /alerts)"]
          if s.prometheus else []),
        "",
        *key_lines(creds, tty),
        admin_line(creds, tty),
        (f"  saved to {state / 'credentials.json'} (mode 600, a client credential: the gateway's keys file holds "
        "digests only)"),
        f"  logs in {state / 'logs'}",
        f"  /metrics of every process:    curl{ca} -H \"Authorization: Bearer $(cat {state / 'metrics_token'})\" {gateway.url}/metrics",
        "",
        "Try it:",
        f"  KEY=$(python3 -c \"import json; print(json.load(open('{state / 'credentials.json'}'))['keys']"
        f"['{tier}'])\")" if tier else "  KEY=...   # `switchboard keys create --tenant dev --tier plus` prints one",
        f"  curl -s{ca} {gateway.url}/v1/chat/completions \\",
        "    -H \"Authorization: Bearer $KEY\" \\",
        "    -H 'Content-Type: application/json' \\",
        "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
        "\"max_tokens\": 64}'" if not model else
        "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}'",
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    print("\n".join(lines), flush=True)


def console_lines(s: UpSettings, login: str | None, login_file: Path | None = None) -> list[str]:
    """The console's address; its one-time login link in full, or (`login_file`) where it is."""
    if not s.console:
        return []
    host = console_host(s, s.tls or TlsConfig.from_env().enabled)
    where = [] if host == s.host else [(f"  {'':<28}  (loopback only: --host {s.host} without --tls would send the "
                                        "admin token in plain text; add --tls to serve it there)")]
    if not login:
        return [f"  admin console                 http://{host}:{s.console_port}", *where]
    if login_file is not None:
        return [f"  admin console                 {login.split('/?', 1)[0]}", *where,
                (f"  {'':<28}  (one-time login link: `cat {login_file}` (mode 600; {NOT_A_TERMINAL}); "
                 "or log in with the admin token)")]
    return [f"  admin console                 {login}", *where,
            f"  {'':<28}  (one-time login link: logs one browser in, once; then log in with the admin token)"]


def admin_line(creds: dict, tty: bool = True) -> str:
    """The admin token in full on the run that made it (shown once, like the dev keys) and on a terminal only:
    the most powerful secret of the platform does not go to every later run's scrollback, nor to a log."""
    if creds.get("admin_minted") and tty:
        return f"  admin token: {creds['admin_token']}   (shown here once, kept in credentials.json below)"
    if creds.get("admin_minted"):
        return f"  admin token: made now, in credentials.json below ({NOT_A_TERMINAL})"
    return "  admin token: in credentials.json below (`switchboard admin` and the console read it there)"


def key_lines(creds: dict, tty: bool = True) -> list[str]:
    """The dev keys in full on the run that made them (shown once) on a terminal; their key ids otherwise."""
    keys: dict[str, str] = creds["keys"]
    if not keys:  # the dev keys were revoked (`switchboard keys revoke`), or credentials.json was lost
        return [("  API keys: no dev key of the keys file is known here (revoked, or credentials.json lost; see the "
                 "log above): `switchboard keys create --tenant dev --tier plus`")]
    if creds.get("minted") and tty:
        return ["  API keys (dev, one per tier; shown here once, kept in credentials.json below):",
                *[f"    {t:<11} {k}" for t, k in keys.items()]]
    made = f"made now, {NOT_A_TERMINAL}; " if creds.get("minted") else ""
    return [f"  API keys (dev, one per tier; {made}the keys are in credentials.json below):",
            *[f"    {t:<11} key id {key_id(k)}" for t, k in keys.items()]]


__all__ = ["LOGIN_LINK_FILE", "banner", "console_host", "console_lines", "forget_login_link", "new_console_login",
           "save_login_link"]
