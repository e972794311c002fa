"""What every process of both planes shares and that knows nothing else of ours: errors (the OpenAI
error tree), HTTP serving (``http_server``, body reading), settings/CLI parsing, telemetry and
tracing, TLS, the cluster token (``hop_auth``), SSE keep-alives, at-rest crypto, background-task
stopping and YAML policy sources.
"""
