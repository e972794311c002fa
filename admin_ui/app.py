"""The Switchboard admin console (Streamlit entry point).

    switchboard console --port 8501 --control-plane-url http://127.0.0.1:8300
    streamlit run admin_ui/app.py -- --control-plane-url http://127.0.0.1:8300   # the same, by hand

Nothing renders before the browser session has logged in (admin_ui/login.py): the admin token in a
password field, or the one-time login link ``/?token=...`` that `switchboard up` and `switchboard
console` print. One page per concern (``admin_ui/screens/``); every page reads only the control
plane's admin API through :mod:`admin_ui.client`, refreshes itself, and says when the control plane
is unreachable.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from admin_ui import login, ui

HERE = Path(__file__).parent

PAGES = [
    # (file, title, icon, url path)
    ("screens/overview.py", "Overview", ":material/monitoring:", "overview"),
    ("screens/cluster.py", "Cluster", ":material/dns:", "cluster"),
    ("screens/traffic.py", "Traffic & tiers", ":material/tune:", "tiers"),
    ("screens/autoscaler.py", "Autoscaler", ":material/autoplay:", "autoscaler"),
    ("screens/degradation.py", "Degradation", ":material/stairs:", "degradation"),
    ("screens/traces.py", "Traces", ":material/timeline:", "traces"),
    ("screens/alerts.py", "Alerts", ":material/notifications_active:", "alerts"),
    ("screens/usage.py", "Usage", ":material/receipt_long:", "usage"),
    ("screens/abuse.py", "Abuse", ":material/gpp_maybe:", "abuse"),
    ("screens/playground.py", "Playground", ":material/chat:", "playground"),
]

CSS = """<style>
[data-testid="stMainBlockContainer"] { padding-top: 2.2rem; padding-bottom: 2rem; }
[data-testid="stMetricValue"] { font-size: 1.9rem; }
h1 { padding-top: 0.2rem; }
</style>"""


def main() -> None:
    st.set_page_config(page_title="Switchboard console", page_icon=":material/hub:", layout="wide")
    c = ui.console()
    allowed = login.gate(c)
    pages = [st.Page(str(HERE / f), title=t, icon=i, url_path=u, default=(u == "overview")) for f, t, i, u in PAGES]
    # Resolved either way, so a deep link (/cluster) lands on its page after the login; shown and run
    # only for a session that has logged in.
    nav = st.navigation(pages, position="sidebar" if allowed else "hidden")
    st.markdown(CSS, unsafe_allow_html=True)
    if not allowed:
        login.form(c)
        return
    st.session_state["_page"] = nav.url_path  # whose actions' outcomes ui.show_flash shows
    with st.sidebar:
        st.markdown("### :material/hub: Switchboard")
        st.caption(f"Control plane: `{c.settings.control_plane_url}`")
        st.toggle("Auto-refresh", value=True, key="auto_refresh",
                  help=f"Re-read the live parts of each page every {c.settings.refresh_s:g} s.")
        login.logout_button()
    nav.run()


main()
