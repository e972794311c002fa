"""The console's pages, one per file, run by Streamlit from admin_ui/app.py's navigation; each reads
the admin API through ``ui.Console`` and draws what admin_ui/views/ computes.
"""
