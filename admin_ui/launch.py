"""`switchboard console`: run the admin console (Streamlit) on loopback.

    switchboard console                                   # http://127.0.0.1:8501
    switchboard console --port 8502 --control-plane-url http://10.0.0.5:8300
    SWITCHBOARD_ADMIN_TOKEN=... switchboard console

Replaces this process with ``python -m streamlit run admin_ui/app.py ...`` (so signals sent to it
reach Streamlit directly). The admin token travels in the environment, never on the command line.
Streamlit answers ``GET /_stcore/health`` with ``ok`` once it serves.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from admin_ui.settings import ConsoleSettings
from data_plane.common.settings_cli import parse_flags

APP = Path(__file__).resolve().parent / "app.py"
PRIMARY_COLOR = "#1f5fbf"
HEALTH_PATH = "/_stcore/health"
"""Where a supervisor polls the console's readiness."""


APP_FIELDS = ("control_plane_url", "gateway_url", "credentials_file", "keys_file", "refresh_s", "timeout_s")
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


def main(argv: list[str] | None = None) -> None:
    cmd = command(argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
