"""The shard's metrics for KV blocks on the cache nodes: vLLM's names where vLLM has them.

    m = KVTierMetrics(registry, model_name="SmolLM2-135M-Instruct")
    m.decisions.labels(model_name=name, decision="fetch").inc()

vLLM's KV-connector names (``vllm:external_prefix_cache_*`` counted in tokens, ``vllm:kv_offload_*``
in bytes and seconds) so its dashboards read the cache-node tier; ``switchboard_shard_kv_*`` for the
rest. Held by ShardMetrics (data_plane/shard/metrics.py) as ``metrics.kv_tier``; fed by
data_plane/shard/kv_tier.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DECISIONS = ("fetch", "recompute", "no_cache_nodes")
"""fetch: the cache nodes were asked (cheaper than recomputing by the learned estimates); recompute:
prefilling was estimated cheaper; no_cache_nodes: none is known to membership."""
FETCH_RESULTS = ("hit", "miss", "unavailable")
"""hit: at least one block came back and was used; miss: the nodes lacked it (or every block was
rejected); unavailable: no node answered (the shard recomputes)."""
REJECT_REASONS = ("checksum", "layout", "malformed", "sealed")
"""sealed: a sealed frame that does not open here (tampered, moved to another hash or tenant, unknown
key) or a plaintext one where sealed frames are required (data_plane/shard/kv_seal.py)."""
CRYPTO_RESULTS = ("ok", "failed", "unknown_key", "plaintext")
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""vLLM's ``vllm:kv_offload_{store,load}_size`` buckets, bytes."""
OFFLOAD_RESULTS = ("stored", "failed", "dropped")
"""stored: acknowledged by at least one replica; failed: by none; dropped: the offload queue was full."""


class KVTierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        m = ["model_name"]
        self.model_name = model_name
        self.queries = Counter("vllm:external_prefix_cache_queries",
                               "Prompt tokens missing locally that were looked up on the cache nodes.", m,
                               registry=registry)
        self.hits = Counter("vllm:external_prefix_cache_hits",
                            "Prompt tokens whose KV came from the cache nodes (fetched, verified and used).", m,
                            registry=registry)
        self.store_bytes = Counter("vllm:kv_offload_store_bytes", "KV bytes sent to the cache nodes.", m,
                                   registry=registry)
        self.load_bytes = Counter("vllm:kv_offload_load_bytes", "KV bytes fetched from the cache nodes.", m,
                                  registry=registry)
        self.store_time = Counter("vllm:kv_offload_store_time", "Seconds spent storing KV on the cache nodes.", m,
                                  registry=registry)
        self.load_time = Counter("vllm:kv_offload_load_time",
                                 "Seconds spent fetching KV from the cache nodes (on the request path).", m,
                                 registry=registry)
        self.store_size = Histogram("vllm:kv_offload_store_size", "KV bytes per store to the cache nodes.", m,
                                    buckets=TRANSFER_SIZE_BUCKETS, registry=registry)
        self.load_size = Histogram("vllm:kv_offload_load_size", "KV bytes per fetch from the cache nodes.", m,
                                   buckets=TRANSFER_SIZE_BUCKETS, registry=registry)
        self.decisions = Counter("switchboard_shard_kv_fetch_decisions",
                                 "Fetch-or-recompute decisions for prompt prefixes missing locally.",
                                 m + ["decision"], registry=registry)
        self.fetches = Counter("switchboard_shard_kv_fetches", "KV fetches from the cache nodes by result.",
                               m + ["result"], registry=registry)
        self.rejected = Counter("switchboard_shard_kv_blocks_rejected",
                                "Fetched KV blocks never used: checksum mismatch, another model/dtype/layout/hash "
                                "(layout), not a frame (malformed), or a sealed frame that does not open "
                                "(sealed); their tokens are recomputed.",
                                m + ["reason"], registry=registry)
        self.offloaded = Counter("switchboard_shard_kv_offload_blocks",
                                 "KV blocks of finished session turns sent to the cache nodes, by result.",
                                 m + ["result"], registry=registry)
        self.crypto = Counter("switchboard_shard_kv_crypto",
                              "KV frames sealed (op=seal) before they go to the cache nodes or opened (op=open) "
                              "after a fetch, by result: ok, failed (tampered, or moved to another hash or "
                              "tenant), unknown_key, plaintext (an unsealed frame, refused).",
                              m + ["op", "result"], registry=registry)
        self.crypto_time = Counter("switchboard_shard_kv_crypto_seconds",
                                   "Seconds spent sealing (op=seal) and opening (op=open) KV frames.",
                                   m + ["op"], registry=registry)
        self.fetch_bandwidth = Gauge("switchboard_shard_kv_fetch_bandwidth_bytes_per_second",
                                     "Learned transfer rate to and from the cache nodes (fetch estimate).", m,
                                     registry=registry)
        self.prefill_rate = Gauge("switchboard_shard_kv_prefill_tokens_per_second",
                                  "Learned prefill speed of this shard (recompute estimate).", m, registry=registry)
        for metric in (self.queries, self.hits, self.store_bytes, self.load_bytes, self.store_time, self.load_time,
                       self.store_size, self.load_size):
            metric.labels(model_name)
        for decision in DECISIONS:
            self.decisions.labels(model_name, decision)
        for result in FETCH_RESULTS:
            self.fetches.labels(model_name, result)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        for result in OFFLOAD_RESULTS:
            self.offloaded.labels(model_name, result)
        self.crypto.labels(model_name, "seal", "ok")
        for result in CRYPTO_RESULTS:
            self.crypto.labels(model_name, "open", result)
        for op in ("seal", "open"):
            self.crypto_time.labels(model_name, op)
