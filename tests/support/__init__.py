"""What every test imports to start processes, read metrics and wait: the one test harness.

    from tests.support.procs import Service, free_port          # a real process on a free loopback port
    from tests.support.cluster import Cluster, KEYS, ADMIN_TOKEN  # control plane, caches, shards, gateway
    from tests.support.metrics import metric, metric_in       # a live process's /metrics, or its text
    from tests.support.waits import eventually                  # poll until true (async: eventually_async)
    from tests.support.chat import chat, assert_openai_error    # one chat call; the OpenAI error shape

Modules: procs (Service, free_port, ROOT, cluster token, `switchboard up`), cluster (Cluster, keys,
stored_session), metrics, waits, chat, postgres (a throwaway PostgreSQL), redis (a throwaway
redis-server), consul_stub (Consul's HTTP API, in-process or as a child), live_platform (a platform
with traffic for the console's browser check). Test modules never import helpers from each other:
what two of them share lives here.
"""
