"""The gateway's rate limits (requests and tokens per minute, per API key and per tier, across gateways):
``limiter`` (what the chat handler asks) over ``buckets`` (the GCRA buckets, in process or in Redis).
"""
