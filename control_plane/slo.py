"""The control plane's service-level objective: its default, named once.

    from control_plane.slo import TTFT_SLO_S
    ControlPlaneSettings().ttft_slo_s == LadderConfig().ttft_slo_s == PolicyConfig().ttft_slo_s == TTFT_SLO_S

Read by the process's settings (control_plane/settings.py, ``--ttft-slo-s``), the degradation
ladder's rule (control_plane/degradation_rule.py ``LadderConfig``) and the autoscaler's
(control_plane/scaling/policy.py ``PolicyConfig``), so their defaults cannot drift apart; a running
control plane hands the one configured value to both (``ladder_config``, ``policy_config``). It
imports nothing: the settings and both rules sit above it (the rules never import the settings).
"""

from __future__ import annotations

TTFT_SLO_S = 2.0
"""Time-to-first-token p95 objective, seconds. Scaling and the ladder hold it against TTFT *beyond
prefill* (queueing), never raw TTFT, which grows with the prompt; the ladder's queue-time threshold
defaults to it too (queueing alone would miss it)."""
