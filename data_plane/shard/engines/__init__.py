"""The shard's inference engines behind one interface (``base``): the torch engine (``torch_engine``
and its ``torch_*`` parts, ``llama_runner``, the prefix cache, speculative decoding), the
``synthetic`` engine for tests, and ``vllm_engine`` (vLLM's server beside a sidecar; the only module
that imports vllm).
"""
