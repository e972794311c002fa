"""`switchboard console`: run the admin console (Streamlit) on loopback.

    switchboard console                                   # http://127.0.0.1:8501
    switchboard console --port 8502 --control-plane-url http://10.0.0.5:8300
    SWITCHBOARD_ADMIN_TOKEN=... switchboard console

Replaces this process with ``python -m streamlit run admin_ui/app.py ...`` (so signals sent to it
reach Streamlit directly). The admin token travels in the environment, never on the command line.
Streamlit answers ``GET /_stcore/health`` with ``ok`` once it serves.

Login (admin_ui/login.py): every browser session logs in with the admin token, or once with the
one-time login link printed here (``http://127.0.0.1:8501/?token=CODE``), as Jupyter prints its
token URL. CODE is minted per start and handed to Streamlit in the environment
(SWITCHBOARD_CONSOLE_LOGIN_CODE, never argv); the link is printed only when stdout is a terminal (a
log file would keep a live login), and not at all when `switchboard up` minted the code (it prints
the link in its own banner, on a terminal only; this process's output is its console.log).

A non-loopback ``--host`` is refused unless the console serves TLS (SWITCHBOARD_TLS_CERT/KEY, as
every other process; `switchboard up --tls`) or ``--allow-insecure-http`` says a TLS-terminating
proxy stands in front: the login form takes the platform's most powerful secret, and plain HTTP
hands it (and the logged-in session) to anyone on the path. With the flag it starts, warning loudly.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from admin_ui.settings import ENV_LOGIN_CODE, ConsoleSettings
from data_plane.common.settings_cli import parse_flags
from data_plane.common.tls import is_loopback

APP = Path(__file__).resolve().parent / "app.py"
PRIMARY_COLOR = "#1f5fbf"
HEALTH_PATH = "/_stcore/health"
"""Where a supervisor polls the console's readiness."""


APP_FIELDS = ("control_plane_url", "gateway_url", "credentials_file", "keys_file", "refresh_s", "timeout_s",
              "session_ttl_s")
"""What the Streamlit app itself reads from its argv (ConsoleSettings.from_argv)."""


def parse_args(argv: list[str] | None) -> tuple[ConsoleSettings, list[str]]:
    """The console's settings (data_plane/common/settings_cli.py) and the flags handed on to the
    app: the ones given here, never the token."""
    settings, given = parse_flags(ConsoleSettings, argv, prog="switchboard console")
    app_args = []
    for name in APP_FIELDS:
        if name in given:
            app_args += ["--" + name.replace("_", "-"), str(getattr(settings, name))]
    return settings, app_args


def command(argv: list[str] | None = None) -> list[str]:
    """The streamlit command line `main` runs."""
    args, app_args = parse_args(argv)
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", str(args.port),
        "--server.address", args.host,
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--client.toolbarMode", "minimal",
        "--theme.base", "light",
        "--theme.primaryColor", PRIMARY_COLOR,  # blue: red stays the colour of trouble
        *tls_flags(),
        "--", *app_args,
    ]


def tls_flags() -> list[str]:
    """Streamlit's own TLS flags when the platform runs on TLS (the variables of data_plane/common/tls.py)."""
    cert, key = os.environ.get("SWITCHBOARD_TLS_CERT"), os.environ.get("SWITCHBOARD_TLS_KEY")
    return ["--server.sslCertFile", cert, "--server.sslKeyFile", key] if cert and key else []


def exposure(settings: ConsoleSettings, tls: bool) -> str | None:
    """None when the console may serve as asked; the warning to print for a non-loopback --host over
    plain HTTP that --allow-insecure-http allowed; SystemExit when it did not."""
    if tls or is_loopback(settings.host):
        return None
    if not settings.allow_insecure_http:
        raise SystemExit(
            f"switchboard console: --host {settings.host} is not a loopback address, and without TLS the admin token "
            f"typed into the console's login form (and every logged-in session) would cross the network in clear "
            f"text. Serve it on TLS (SWITCHBOARD_TLS_CERT and SWITCHBOARD_TLS_KEY, or `switchboard up --tls`), keep "
            f"it on 127.0.0.1 and reach it through an SSH tunnel, or pass --allow-insecure-http when a proxy that "
            f"terminates TLS stands in front of it.")
    return (f"WARNING: switchboard console: serving on {settings.host} over plain HTTP (--allow-insecure-http). "
            f"The admin token typed into the login form crosses the network in clear text unless a proxy that "
            f"terminates TLS stands in front. Do not expose this port directly.")


def login_url(settings: ConsoleSettings, code: str, tls: bool) -> str:
    """The one-time login link: this console's address with ``?token=CODE``."""
    host = settings.host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{settings.port}/?token={code}"


def main(argv: list[str] | None = None) -> None:
    settings, _ = parse_args(argv)
    tls = bool(tls_flags())
    warning = exposure(settings, tls)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if not os.environ.get(ENV_LOGIN_CODE):  # `switchboard up` mints it and prints the link itself
        code = secrets.token_urlsafe(32)
        os.environ[ENV_LOGIN_CODE] = code  # inherited by Streamlit through execv; not in argv
        if sys.stdout.isatty():
            print(f"Console login link (logs one browser in, once): {login_url(settings, code, tls)}", flush=True)
        else:
            print("Console: log in with the admin token (no one-time login link printed: stdout is not a terminal, "
                  "and a log must not keep a live login).", flush=True)
    cmd = command(argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
