"""Streamlit plumbing shared by every page: the console's context, fetching with honest errors,
the live (auto-refreshing) region, status colours.

    console = ui.console()                         # settings + clients, one per process
    @ui.live("cluster")                            # re-runs every refresh_s; says when the CP is down
    def body(c: ui.Console) -> None:
        members = ui.fetch("Members", c.admin.members)
        if members is not None:
            ...

Pages never call httpx: every call goes through :mod:`admin_ui.client`, and every failure is
rendered here, once, in words an operator can act on.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import altair as alt
import streamlit as st

from admin_ui import login
from admin_ui.client import (
    AdminClient,
    ConsoleError,
    GatewayClient,
    NotAvailable,
    Rejected,
    Unauthorized,
    Unreachable,
)
from admin_ui.settings import ENV_ADMIN_TOKEN, ConsoleSettings
from data_plane.common.ladder import Level

T = TypeVar("T")

STATUS_COLORS = {"passing": "green", "draining": "orange", "critical": "red"}
"""Member status -> badge colour."""
STATUS_CSS = {
    "green": "background-color: #e6f4ea; color: #1e6b34; font-weight: 600",
    "orange": "background-color: #fff1de; color: #a35200; font-weight: 600",
    "red": "background-color: #fde7e7; color: #b3261e; font-weight: 600",
    "blue": "background-color: #e8f0fe; color: #1a4fb5; font-weight: 600",
    "gray": "color: #6b6b6b",
}
"""Cell styles for status words in tables (st.dataframe renders a pandas Styler's colours)."""
WORD_COLORS = {
    "passing": "green", "ok": "green", "steady": "green", "resolved": "green",
    "draining": "orange", "hold": "gray", "warning": "orange", "scale_up": "blue", "scale_down": "blue",
    "critical": "red", "error": "red", "firing": "red",
    "info": "blue", "auto": "gray", "operator": "orange",
}
LEVEL_LABELS = {int(level): level.title for level in Level}
"""The degradation ladder, as the design names its rungs."""
LEVEL_COLORS = {0: "green", 1: "blue", 2: "orange", 3: "red", 4: "red"}


@dataclass(frozen=True)
class Console:
    settings: ConsoleSettings
    admin: AdminClient
    gateway: GatewayClient


def _argv() -> list[str]:
    # `streamlit run admin_ui/app.py -- --control-plane-url ...`: Streamlit leaves our flags in argv.
    return list(sys.argv[1:]) if "streamlit" in os.path.basename(sys.argv[0]) or sys.argv[0].endswith("app.py") else []


@st.cache_resource(show_spinner=False, max_entries=8)  # a rewritten credentials file makes a new entry
def _console(argv: tuple[str, ...], env_key: tuple[str | None, ...]) -> Console:
    settings = ConsoleSettings.from_argv(list(argv))
    admin = AdminClient(settings.control_plane_url, settings.admin_token_value(), timeout_s=settings.timeout_s)
    return Console(settings, admin, GatewayClient(settings.gateway_url))


def console() -> Console:
    """The console's settings and clients (cached per process, rebuilt if the environment or the
    credentials file changes: an operator who fixes the token there, or a `switchboard up` that
    rewrote it, is heard on the next refresh instead of after a console restart)."""
    keys = ("SWITCHBOARD_CONTROL_PLANE_URL", "SWITCHBOARD_GATEWAY_URL", ENV_ADMIN_TOKEN,
            "SWITCHBOARD_CREDENTIALS_FILE", "SWITCHBOARD_CONSOLE_KEYS_FILE", "SWITCHBOARD_CONSOLE_REFRESH_S")
    argv = tuple(_argv())
    return _console(argv, (*(os.environ.get(k) for k in keys), _credentials_stamp(argv)))


def _credentials_stamp(argv: tuple[str, ...]) -> str | None:
    """The credentials file's identity and mtime (None when there is none): part of the cache key."""
    path = ConsoleSettings.from_argv(list(argv)).credentials_file
    try:
        stat = os.stat(os.path.expanduser(path))
    except OSError:
        return None
    return f"{path}:{stat.st_ino}:{stat.st_mtime_ns}:{stat.st_size}"


def fetch(what: str, call: Callable[[], T], *, quiet_unavailable: bool = False,
          quiet_refused: bool = False) -> T | None:
    """Run one admin-API call; on failure say why (in place) and return None. `quiet_refused`: for a
    call outside the live region, whose banner already says the token is refused."""
    try:
        return call()
    except Unreachable as exc:
        st.error(f"**{what}: control plane unreachable.** {exc.message}", icon=":material/power_off:")
    except Unauthorized as exc:
        if quiet_refused:
            return None
        st.error(f"**{what}: the admin token was refused** ({exc.message}). {token_hint(console())}",
                 icon=":material/lock:")
    except NotAvailable:
        if not quiet_unavailable:
            st.info(f"**{what}: not available yet** on this control plane (the endpoint answered 404).", icon=":material/construction:")
    except Rejected as exc:
        st.error(f"**{what}: the control plane answered {exc.status}:** {exc.message}", icon=":material/warning:")
    return None


def act(what: str, call: Callable[[], Any], *, about: str | None = None) -> bool:
    """Run one state-changing call and leave a flash message for the next render; nothing for a session
    that is no longer logged in (a button's on_click runs before app.py's gate: admin_ui/login.py).
    `about`: what the outcome is about (see `flash`)."""
    if not login.logged_in(console()):
        return False
    try:
        call()
    except ConsoleError as exc:
        kind = "not available yet on this control plane" if isinstance(exc, NotAvailable) else exc.message
        flash("error", f"{what} failed: {kind}", about=about)
        return False
    flash("success", f"{what}: done.", about=about)
    return True


FLASH_S = 20.0
"""How long an action's outcome stays on its page. Most pages show it inside their live region, which
re-runs every refresh_s: shown once and dropped, a "done" or a refusal was gone within 3 s."""
FLASH_KEEP = 3
"""The most outcomes shown at once (the latest)."""


def flash(kind: str, message: str, *, about: str | None = None) -> None:
    """Leave an action's outcome for its page: shown on every run of that page for FLASH_S. An outcome
    `about` something (the pin, one shard's drain, one abuse action) replaces the page's earlier one about
    the same: a refused pin stayed red beside the pin that then worked, as if that had failed too."""
    page = st.session_state.get("_page")
    shown = [f for f in st.session_state.get("_flash", [])
             if about is None or len(f) < 5 or (f[2], f[4]) != (page, about)]
    shown.append((kind, message, page, time.time(), about))
    st.session_state["_flash"] = shown[-FLASH_KEEP:]


def show_flash() -> None:
    """The outcomes of this page's recent actions (of another page's: kept for that page, until they expire)."""
    now, page = time.time(), st.session_state.get("_page")
    kept = [f for f in st.session_state.get("_flash", []) if now - f[3] < FLASH_S]
    st.session_state["_flash"] = kept
    for kind, message, where, *_ in kept:
        if where == page:
            (st.success if kind == "success" else st.error)(
                message, icon=":material/check_circle:" if kind == "success" else "⚠️")


def header(title: str, caption: str) -> None:
    st.title(title)
    st.caption(caption)


def live(name: str) -> Callable[[Callable[[Console], None]], Callable[[], None]]:
    """Decorate a page body: it re-runs every ``refresh_s`` (unless paused in the sidebar), and
    when the control plane does not answer it shows one clear banner instead of the body."""

    def wrap(body: Callable[[Console], None]) -> Callable[[], None]:
        c = console()
        every = c.settings.refresh_s if st.session_state.get("auto_refresh", True) else None

        @st.fragment(run_every=every)
        def region() -> None:
            if not login.logged_in(c):  # expired or logged out meanwhile: a fragment's rerun skips app.py
                st.rerun(scope="app")
            if not c.admin.health():
                unreachable_banner(c)
                return
            try:  # the cheapest authenticated read: a refused token is said once, not once per call
                c.admin.members()
            except Unauthorized as exc:
                token_banner(c, exc)
                return
            except ConsoleError:
                pass  # the page's own calls say what else is wrong, each in place
            zone_banner(c)
            body(c)
            st.caption(f"Updated {time.strftime('%H:%M:%S')} · every {c.settings.refresh_s:g} s"
                       if every else f"Updated {time.strftime('%H:%M:%S')} · auto-refresh paused")

        def run() -> None:
            region()

        run.__name__ = name
        return run

    return wrap


def zone_banner(c: Console) -> None:
    """On every page, while a zone has lost all its shards: which, since when, and what it means."""
    try:
        zones = c.admin.zones()
    except ConsoleError:
        return  # the page's own calls say what is wrong with the control plane
    down = [z for z in zones.get("zones", []) if z.get("state") == "down"]
    if not down:
        return
    names = ", ".join(f"**{z['zone']}**" for z in down)
    since = min((z.get("since") or time.time()) for z in down)
    st.error(
        f"### Zone down: {names}\n"
        f"No passing shard there for {max(0, time.time() - since):.0f} s. Gateways route to the other zones; "
        f"paid sessions continue from their replica elsewhere, free sessions that lived there are lost. "
        f"Add capacity in the surviving zones (runbook: SwitchboardZoneDown).",
        icon=":material/public_off:",
    )


def token_hint(c: Console) -> str:
    """Where this console's token came from, so the operator fixes the right place."""
    if c.settings.admin_token is not None and c.settings.admin_token.get_secret_value():
        source = f"the console sends {ENV_ADMIN_TOKEN}"
    elif c.admin.has_token:
        source = f"the console read `admin_token` from `{c.settings.credentials_file}`"
    else:
        source = f"the console has no token: {ENV_ADMIN_TOKEN} is unset and `{c.settings.credentials_file}` holds none"
    return (f"{source[0].upper()}{source[1:]}. Set {ENV_ADMIN_TOKEN}, or point `--credentials-file` at the file "
            f"`switchboard up` wrote (its `admin_token`), to the control plane's admin token.")


def token_banner(c: Console, exc: ConsoleError) -> None:
    """The whole page's answer when the admin API refuses the token: every figure below would be a
    blank made to look like an empty cluster ("0/0 passing", "No shards registered")."""
    st.error(
        f"### Admin token refused\n"
        f"The control plane at **{c.settings.control_plane_url}** answers, but refuses this console's token "
        f"({exc.message}), so nothing on this page can be shown. {token_hint(c)} Retrying every "
        f"{c.settings.refresh_s:g} s.",
        icon=":material/lock:",
    )


def unreachable_banner(c: Console) -> None:
    st.error(
        f"### Control plane unreachable\n"
        f"Nothing answers at **{c.settings.control_plane_url}**, so nothing on this page is live. "
        f"Start the platform with `switchboard up`, or point the console at the right place with "
        f"`--control-plane-url` / `SWITCHBOARD_CONTROL_PLANE_URL`. Retrying every {c.settings.refresh_s:g} s.",
        icon=":material/power_off:",
    )


def colour_words(frame: Any, columns: list[str]) -> Any:
    """A Styler that colours status words (``passing``, ``error``, ``scale_up``…) in `columns`."""

    def css(value: Any) -> str:
        word = str(value).split(" ")[0].lower() if value is not None else ""
        return STATUS_CSS.get(WORD_COLORS.get(word, ""), "")

    present = [c for c in columns if c in frame.columns]
    return frame.style.map(css, subset=present) if present else frame


# Vega's default time axis labels minute ticks "%I:%M": 12-hour, no am/pm, so at 19:30 the charts read
# "07:30" beside "Updated 19:30:47" and the tables' 19:29:30. Every time axis here says 24-hour time
# (seconds ticks ":%S", midnight its date), as the rest of the console does.
TIME_LABELS = ("hours(datum.value) || minutes(datum.value) || seconds(datum.value) ? "
               "timeFormat(datum.value, seconds(datum.value) ? ':%S' : '%H:%M') : timeFormat(datum.value, '%b %d')")


def time_x(field: str = "time") -> alt.X:
    """The x encoding of a chart over time: `field` (a datetime column) on the 24-hour axis."""
    return alt.X(f"{field}:T", title=None, axis=alt.Axis(labelExpr=TIME_LABELS))


def tier_chart(frame: Any, *, stacked: bool, height: int) -> alt.Chart:
    """Requests per second by tier over time (:func:`admin_ui.views.tiers.tier_history_frame`): stacked
    areas (demand, all of it) or lines (each tier's own level)."""
    chart = alt.Chart(frame)
    mark = chart.mark_area(opacity=0.85) if stacked else chart.mark_line()
    return mark.encode(
        x=time_x(), y=alt.Y("value:Q", title="req/s", stack="zero" if stacked else None),
        color=alt.Color("tier:N", title="tier", legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "tier:N", alt.Tooltip("value:Q", format=".2f")],
    ).properties(height=height)


def badge(label: str, color: str) -> str:
    """Inline coloured badge markdown (``:green-badge[...]``)."""
    return f":{color}-badge[{label}]"


_TILE_DELTA = {"ok": ("OK", "green"), "warn": ("watch", "orange"), "bad": ("breach", "red"),
               "unknown": ("no data", "gray"), "absent": ("not reported", "gray")}


def tiles(tiles: list[Any], per_row: int = 4) -> None:
    """SLO tiles (:class:`admin_ui.views.signals.Tile`) as bordered metrics with sparklines and a status word."""
    for start in range(0, len(tiles), per_row):
        cols = st.columns(per_row)
        for col, tile in zip(cols, tiles[start:start + per_row]):
            word, color = _TILE_DELTA.get(tile.status, ("", "gray"))
            with col:
                st.metric(tile.label, tile.value, delta=word, delta_color=color, delta_arrow="off",  # type: ignore[arg-type]
                          help=tile.help, border=True, chart_data=tile.series[-60:] or None, chart_type="area")
