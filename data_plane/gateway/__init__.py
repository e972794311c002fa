"""The gateway process (``switchboard gateway``): the OpenAI-compatible front door. ``app`` builds it;
``chat`` handles one request and ``stream`` writes its SSE back; auth, admission, fair share, the
context window, cluster state, usage, metrics and settings beside them; ``ratelimit/`` and ``safety/``
hold the rate limiter and the safety filters.
"""
