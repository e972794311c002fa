"""The shard process (``switchboard shard``): ``app`` (the HTTP server over an engine), its metrics,
the KV transcript and tier modules, and ``engines/`` (the inference engines); never imports the
gateway, routing or the cache.
"""
