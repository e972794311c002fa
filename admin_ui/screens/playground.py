"""Playground: send a chat to the gateway as a chosen tier's key, watch it stream, follow its trace;
through chat completions (the whole conversation each turn) or the Responses API (the gateway keeps it).
The answer can be shaped by a JSON schema (`response_format`) or tools (the calls are shown, with their
arguments); those go through chat completions.

A console page: Streamlit runs it from admin_ui/app.py's navigation (``PAGES``); it talks to the
gateway (admin_ui/client.py) and links the request's trace on the Traces page.
"""

from __future__ import annotations

import json
import time

import streamlit as st

from admin_ui import ui
from admin_ui.client import ChatDelta, ChatEnd, ChatStart, ChatToolCall, ConsoleError
from admin_ui.views.playground import (
    EXAMPLE_SCHEMA,
    EXAMPLE_TOOLS,
    OUTPUTS,
    ToolCalls,
    output_fields,
    structured_json,
)
from data_plane.gateway.auth import key_digest

ui.header("Playground", "Talk to the platform exactly as a user of a tier would, then open the request's trace.")

c = ui.console()
if not c.admin.health():
    ui.unreachable_banner(c)

keys = c.settings.dev_keys()
CUSTOM = "custom key…"
left, mid, right = st.columns([2, 1, 1])
choices = [*keys, CUSTOM] if keys else [CUSTOM]
tier = left.selectbox("Send as", choices, key="pg_tier", index=choices.index("plus") if "plus" in choices else 0,
                      format_func=lambda t: t if t == CUSTOM else f"{t} tier  (key id {key_digest(keys[t])[:12]})",
                      help=f"Dev keys from {c.settings.credentials_file} (written by `switchboard up`)"
                           + (f" that {c.settings.keys_file} still accepts." if c.settings.keys_file else "."))
if tier == CUSTOM:
    st.text_input("API key", type="password", key="pg_key")
max_tokens = mid.number_input("Max tokens", min_value=1, max_value=4096, value=128, step=16, key="pg_max_tokens")
temperature = right.number_input("Temperature", min_value=0.0, max_value=2.0, value=0.0, step=0.1, key="pg_temp")
api = st.radio("API", ["Chat completions", "Responses"], key="pg_api", horizontal=True,
               help="Chat completions sends the whole conversation each turn; the Responses API sends only the "
                    "new message and the gateway keeps the conversation (previous_response_id).")
output = st.radio("Output", OUTPUTS, key="pg_output", horizontal=True,
                  help="Text; JSON following a schema (response_format json_schema); or tool calls (tools). "
                       "The last two go through chat completions.")
st.caption(f"Gateway: `{c.settings.gateway_url}`")

history: list[dict[str, str]] = st.session_state.setdefault("pg_history", [])
for turn in history:
    with st.chat_message(turn["role"]):
        st.markdown(turn["content"])

prompt = st.text_area("Message", key="pg_prompt", height=90, placeholder="What is the capital of France?")
if output == "JSON schema":
    st.text_area("JSON schema", value=EXAMPLE_SCHEMA, key="pg_schema", height=180)
elif output == "Tools":
    st.text_area("Tools (a JSON list)", value=EXAMPLE_TOOLS, key="pg_tools", height=180)
    choice_col, parallel_col = st.columns([2, 1])
    choice_col.radio("Tool choice", ["auto", "required"], key="pg_tool_choice", horizontal=True)
    parallel_col.checkbox("Parallel calls", value=False, key="pg_parallel",
                          help="parallel_tool_calls: the model may call several tools at once (off here by "
                               "default: a small model tends to repeat a call until the token limit).")
send_col, clear_col, _ = st.columns([1, 1.4, 3.6])  # 1:1 cut "New conversation" to "New conversat…" at 1440 px
send = send_col.button("Send", type="primary", icon=":material/send:", width="stretch")
if clear_col.button("New conversation", icon=":material/restart_alt:", width="stretch"):
    st.session_state["pg_history"] = []
    st.session_state.pop("pg_last", None)
    st.session_state.pop("pg_response_id", None)
    st.rerun()



def show_calls(tool_calls: list[dict]) -> None:
    """Each tool call: its name, id and arguments (pretty JSON when they parse)."""
    for call in tool_calls:
        st.markdown(f"**Tool call** `{call['name']}` · id `{call['id']}`")
        parsed, _problem = structured_json(call["arguments"])
        st.code(json.dumps(parsed, indent=2, ensure_ascii=False) if parsed is not None else call["arguments"],
                language="json")


calls_shown = False  # this run's tool calls are in the assistant's bubble (not repeated below it)
if send:
    api_key = keys.get(tier) if tier != CUSTOM else st.session_state.get("pg_key")
    text = (prompt or "").strip()
    fields: dict | None
    try:
        fields = output_fields(output, st.session_state.get("pg_schema", EXAMPLE_SCHEMA),
                               st.session_state.get("pg_tools", EXAMPLE_TOOLS),
                               st.session_state.get("pg_tool_choice", "auto"),
                               st.session_state.get("pg_parallel", False))
    except ValueError as exc:
        fields = None
        st.error(str(exc), icon=":material/data_object:")
    if not api_key:
        st.error("Choose a tier with a dev key, or enter an API key.", icon=":material/key:")
    elif not text:
        st.error("Type a message first.", icon=":material/edit:")
    elif fields is not None:
        messages = [*history, {"role": "user", "content": text}]
        with st.chat_message("user"):
            st.markdown(text)
        meta: dict = {"t0": time.monotonic(), "chunks": 0}
        calls = ToolCalls()

        def stream():
            events = (c.gateway.stream_response(api_key, text, max_tokens=int(max_tokens),
                                                temperature=float(temperature),
                                                previous_response_id=st.session_state.get("pg_response_id"))
                      if api == "Responses" and not fields else
                      c.gateway.stream_chat(api_key, messages, max_tokens=int(max_tokens),
                                            temperature=float(temperature), output=fields))
            for event in events:
                if isinstance(event, ChatStart):
                    meta["start"] = event
                elif isinstance(event, ChatDelta):
                    meta.setdefault("ttft", time.monotonic() - meta["t0"])
                    meta["chunks"] += 1
                    yield event.text
                elif isinstance(event, ChatToolCall):
                    meta.setdefault("ttft", time.monotonic() - meta["t0"])
                    calls.add(event)
                elif isinstance(event, ChatEnd):
                    meta["end"] = event

        with st.chat_message("assistant"):
            try:
                answer = st.write_stream(stream())
            except ConsoleError as exc:
                answer = ""
                st.error(exc.message, icon=":material/power_off:")
            if calls.done():  # a tool-call answer has no text: the bubble shows the calls
                show_calls(calls.done())
                calls_shown = True
        meta["total"] = time.monotonic() - meta["t0"]
        end, start = meta.get("end"), meta.get("start")
        if end is not None and end.error:
            st.error(f"The gateway answered {start.status if start else '?'}: {end.error}", icon=":material/block:")
        if end is not None and end.response_id:
            st.session_state["pg_response_id"] = end.response_id
        if answer and not (end and end.error) and not calls.done():  # tool calls are not kept in the history
            history.extend([{"role": "user", "content": text}, {"role": "assistant", "content": str(answer)}])
        st.session_state["pg_last"] = {
            "request_id": start.request_id if start else None, "trace_id": start.trace_id if start else None,
            "status": start.status if start else None, "ttft": meta.get("ttft"), "total": meta["total"],
            "usage": (end.usage if end else None) or {}, "finish": end.finish_reason if end else None,
            "degraded": (start.headers.get("x-switchboard-degraded") if start else None),
            "remaining": (start.headers.get("x-ratelimit-remaining-requests") if start else None),
            "tool_calls": calls.done(), "json": output == "JSON schema", "answer": str(answer or ""),
        }

last = st.session_state.get("pg_last")
if last:
    usage = last["usage"]
    out_tokens = usage.get("completion_tokens")
    cols = st.columns(5)
    cols[0].metric("HTTP status", last["status"] or "—", border=True)
    cols[1].metric("Time to first token", f"{last['ttft'] * 1000:.0f} ms" if last["ttft"] else "—", border=True)
    cols[2].metric("Total", f"{last['total']:.2f} s", border=True)
    cols[3].metric("Tokens in / out", f"{usage.get('prompt_tokens', '—')} / {out_tokens or '—'}", border=True)
    rate = (out_tokens / last["total"]) if out_tokens and last["total"] else None
    cols[4].metric("Tokens / s", f"{rate:.1f}" if rate else "—", border=True)
    notes = [f"request id `{last['request_id'] or '—'}`", f"finish `{last['finish'] or '—'}`"]
    if last.get("degraded"):
        notes.append(f"degraded to level {last['degraded']}")
    if last.get("remaining") is not None:
        notes.append(f"{last['remaining']} requests left this minute")
    st.caption(" · ".join(notes))
    if not calls_shown:  # after a rerun the bubble is gone (tool calls are not kept in the history)
        show_calls(last.get("tool_calls") or [])
    if last.get("json") and last.get("answer"):
        parsed, problem = structured_json(last["answer"])
        if problem is None:
            st.markdown("**Valid JSON** (the answer follows the schema)")
            st.json(parsed)
        else:
            st.warning(f"The answer is not valid JSON ({problem}): the limit may have cut it.", icon=":material/warning:")
    if last["trace_id"]:
        st.page_link("screens/traces.py", label=f"Open trace {last['trace_id']}", icon=":material/timeline:",
                     query_params={"trace": last["trace_id"]})
