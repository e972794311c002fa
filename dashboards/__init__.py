"""Grafana dashboards (``grafana/*.json``, provisioning) and their tooling: ``catalogue`` (which process
exports which metrics; docs/metrics.md is generated from it) and ``push`` (uploading the dashboards
to a Grafana).
"""
