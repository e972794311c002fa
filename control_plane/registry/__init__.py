"""Membership registries the control plane hosts or reads: ``embedded`` (the registry every member
registers in without Consul, with its HTTP API) and ``consul`` (the control plane on Consul: members with
their health, desired state and policies in Consul's KV).
"""
