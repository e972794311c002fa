"""The data plane: everything on the request path (gateway, routing, shards, cache nodes, usage ledger),
the pieces every process shares (``common``), the wire schema (``protocol``) and tier model (``tiers``)
both planes use, and model weights (``model_store``); never imports the control plane (README, "Map of
the code"; the import rules in pyproject.toml).
"""
