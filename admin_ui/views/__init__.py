"""Views: admin-API answers turned into what a console page shows (tiles, tables, chart data).

Pure functions, no Streamlit, one module per page area: ``read`` (lenient readers and formatters
every other module uses), ``signals`` (the latest/history split, the overload view, the SLO
tiles), ``cluster`` (the member table), ``tiers`` (the tier policy table, per-tier traffic),
``alerts``, ``decisions`` (the autoscaler's log and replicas chart) and ``traces`` (list and
waterfall). The pages in admin_ui/screens/ call them; tests/admin_ui/test_views.py tests them.
"""
