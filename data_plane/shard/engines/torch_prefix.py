"""The torch engine's side of prefix caching: a PrefixCache bound to the runner's slot KV cache.

    prefix = SlotPrefix.build(runner, model_id="/models/smollm2", dtype="float32", block_size=16,
                              budget_bytes=0, on_evict=listener.on_kv_evict)   # 0 = auto budget
    hashes = prefix.hashes(prompt_ids, salt="tenant:acme")          # when the request arrives
    hit = prefix.cached_tokens(hashes, len(prompt_ids))             # while admitting (no side effect)
    held = prefix.load(hashes, hit, slot)                           # copy-in, blocks referenced
    held += prefix.keep(hashes, hit, slot)                          # once the prompt is prefilled
    prefix.finish(tokens_in_slot, salt, public, slot, hit, held)    # when the sequence ends

All of it runs on the engine's scheduler thread (data_plane/shard/engines/torch_engine.py); the cache itself,
its addressing and why slots + copy-in are in data_plane/shard/engines/kv_cache.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

from data_plane.shard.engines.kv_cache import BlockHasher, CacheEvents, PrefixCache, auto_budget_bytes, layout_seed

if TYPE_CHECKING:
    from data_plane.shard.engines.llama_runner import LlamaRunner

log = logging.getLogger(__name__)


class SlotPrefix:
    def __init__(self, runner: LlamaRunner, cache: PrefixCache, hasher: BlockHasher) -> None:
        self._runner = runner
        self.cache = cache
        self.hasher = hasher
        self.block_size = cache.block_size

    @classmethod
    def build(cls, runner: LlamaRunner, *, model_id: str, dtype: str, block_size: int, budget_bytes: int,
              on_evict: Callable[[str, int], None]) -> "SlotPrefix":
        r = runner
        layout = f"llama.L{r.num_layers}.kvh{r.num_kv_heads}.d{r.head_dim}.bs{block_size}"
        hasher = BlockHasher(layout_seed(model_id, dtype, layout), block_size)
        cache = PrefixCache(num_layers=r.num_layers, kv_heads=r.num_kv_heads,
                            head_dim=r.head_dim, block_size=block_size,
                            dtype=r.dtype, budget_bytes=budget_bytes or auto_budget_bytes(),
                            events=CacheEvents(on_evict=on_evict))
        log.info("prefix cache: %d blocks of %d tokens (%.0f MiB budget)", cache.num_blocks, block_size,
                 cache.capacity_bytes / 2**20)
        return cls(runner, cache, hasher)

    def hashes(self, ids: Sequence[int], salt: str | None, public_tokens: int) -> list[bytes]:
        return self.hasher.hashes(ids, salt, public_tokens)

    def cached_tokens(self, hashes: Sequence[bytes], prompt_len: int) -> int:
        """Prompt tokens the cache holds, leaving at least one to compute (its logits start the reply)."""
        bs = self.block_size
        return bs * self.cache.probe(hashes, (prompt_len - 1) // bs)

    def load(self, hashes: Sequence[bytes], hit_tokens: int, slot: int) -> list[int]:
        held = self.cache.acquire(hashes[: hit_tokens // self.block_size])
        self.cache.load(held, self._runner.k_cache, self._runner.v_cache, slot)
        return held

    def keep(self, hashes: Sequence[bytes], hit_tokens: int, slot: int) -> list[int]:
        """The prompt's new full blocks enter the cache, referenced (a concurrent request with the
        same prefix, e.g. a shared system prompt, hits them at once)."""
        return self.cache.store(hashes, self._runner.k_cache, self._runner.v_cache, slot,
                                hit_tokens // self.block_size, hold=True)

    def finish(self, tokens: Sequence[int], salt: str | None, public_tokens: int, slot: int, hit_tokens: int,
               held: Sequence[int]) -> None:
        """Every full block of what the slot holds (prompt + output so far) is kept for the
        conversation's next turn; then the sequence's references are released."""
        if slot >= 0 and len(tokens) >= self.block_size:
            self.cache.store(self.hashes(tokens, salt, public_tokens), self._runner.k_cache,
                             self._runner.v_cache, slot, hit_tokens // self.block_size)
        self.cache.release(held)
