"""Routing inside the gateway: ``router`` (which shard serves a request) with its ``policies``,
KV-aware routing, ``upstream`` (supervised streams with retry and resume) and ``hop_client`` (the
HTTP client to the shards); never imports the gateway, the shard or the cache.
"""
