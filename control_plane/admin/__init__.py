"""The admin API (``/admin/v1``, read by the console and operators): ``api`` (members, signals,
decisions, tiers, degradation, drain), ``alerting``, ``traces`` (recent spans gathered from every
process) and ``usage`` (the usage ledger's reports).
"""
