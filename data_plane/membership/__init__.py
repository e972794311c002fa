"""Membership: ``view`` (the MembershipView protocol every router reads, Member), ``embedded`` (the
embedded registry's client and agents), ``consul`` (the same over Consul), ``factory`` (one of them
from a URL) and ``placement`` (zones).
"""
