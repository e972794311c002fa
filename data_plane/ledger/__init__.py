"""The usage ledger: ``writer`` (the gateway's spool and batched flush of one record per request) and
``store`` (SQLite or PostgreSQL, which the control plane's usage API also reads).
"""
