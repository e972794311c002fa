"""The admin console (Streamlit, ``switchboard console``): ``app`` (the entry point and navigation),
``ui`` (shared widgets), ``client`` (the admin API and chat clients), ``settings``/``launch``, one page
per file in ``screens/`` and the pure page data in ``views/``.
"""
