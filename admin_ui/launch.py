"""`switchboard console`: run the admin console (Streamlit) on loopback.

    switchboard console                                   # http://127.0.0.1:8501
    switchboard console --port 8502 --control-plane-url http://10.0.0.5:8300
    SWITCHBOARD_ADMIN_TOKEN=... switchboard console

Replaces this process with ``python -m streamlit run admin_ui/app.py ...`` (so signals sent to it
reach Streamlit directly). The admin token travels in the environment, never on the command line.
Streamlit answers ``GET /_stcore/health`` with ``ok`` once it serves.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from admin_ui.settings import build_parser

APP = Path(__file__).resolve().parent / "app.py"
ENV_PORT = "SWITCHBOARD_CONSOLE_PORT"
ENV_HOST = "SWITCHBOARD_CONSOLE_HOST"
PRIMARY_COLOR = "#1f5fbf"
HEALTH_PATH = "/_stcore/health"
"""Where a supervisor polls the console's readiness."""


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser("switchboard console")
    parser.add_argument("--port", type=int, default=int(os.environ.get(ENV_PORT, "8501")),
                        help=f"console port [env {ENV_PORT}; default 8501]")
    parser.add_argument("--host", default=os.environ.get(ENV_HOST, "127.0.0.1"),
                        help=f"address to bind [env {ENV_HOST}; default 127.0.0.1]")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error("--port must be 1..65535")
    app_args = []
    for flag in ("control_plane_url", "gateway_url", "credentials_file", "refresh_s"):
        value = getattr(args, flag)
        if value is not None:
            app_args += ["--" + ("refresh" if flag == "refresh_s" else flag.replace("_", "-")), str(value)]
    return args, app_args


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


def main(argv: list[str] | None = None) -> None:
    cmd = command(argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
