"""Automatic prefix caching for the torch engine: content-addressed KV blocks kept after requests end.

    chain = BlockHasher(seed=layout_seed("SmolLM2-135M-Instruct", "float32", "L30.kvh3.d64"), block_size=16)
    hashes = chain.hashes(prompt_ids, salt="tenant:acme")        # one digest per *full* block
    cache = PrefixCache(num_layers=30, kv_heads=3, head_dim=64, block_size=16,
                        dtype=torch.float32, budget_bytes=512 << 20)
    hit = cache.acquire(hashes[:cache.probe(hashes, max_blocks)])  # pool indices, referenced
    cache.load(hit, k_cache, v_cache, slot)                        # copy-in: positions 0..len(hit)*16
    ...
    cache.release(hit)                                             # when the sequence ends
    cache.store(hashes, k_cache, v_cache, slot, upto_tokens)       # its full blocks, for the next turn

Addressing follows vLLM's automatic prefix caching: block i's digest is xxh3-128 over the parent
block's digest and block i's token ids, so a digest names the whole prefix up to it. The chain
starts from a seed of the model id, dtype, KV layout and weight format (a block made by another model, layout
or weight format
can never match), and the tenant's salt is mixed into the first block that is not part of an
operator-marked public prefix (isolation: another tenant's identical prompt never hits, so
reuse is no timing side channel between tenants). Python's `hash()` is never used: it is salted
per process, and digests must mean the same thing on every shard.

Storage is a preallocated pool (`torch.empty`, so pages are only touched when used) of
`budget_bytes // block_bytes` blocks, one tensor per layer for K and for V, laid out
`[kv_heads, blocks, block_size, head_dim]` so a request's run of blocks moves with one
`index_select` / `index_copy_` per layer. Blocks referenced by a running sequence are never
evicted; unreferenced ones sit in an LRU and the least recently used is reused first. A
chain's blocks are touched tail first, so its head (shared by more prefixes) is evicted last.

Why slots plus copy-in rather than paged attention (measured on this 2-core CPU, fp32,
SmolLM2-135M, see docs/kv-cache.md): copying 1,536 cached tokens into a slot costs ~8 ms and
out ~3.5 ms, once per request, against ~1.6 s to prefill them; a paged decode step would gather
every sequence's blocks per layer on *every* step (+11 ms on a 63 ms step at 4 x 1,000
tokens, +18 %). The slot cache keeps its contiguous views for decoding.

Everything here runs on the engine's scheduler thread; nothing is locked.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block (vLLM's default); see docs/kv-cache.md for the measurement."""
AUTO_BUDGET_FRACTION = 16
"""With no explicit budget, the cache may use 1/16 of the machine's memory ..."""
AUTO_BUDGET_CAP = 1 << 30
"""... and at most 1 GiB."""

EVICT_CAPACITY = "capacity"
"""An unreferenced block was reused for a new one (LRU, the byte budget is full)."""
EVICT_NO_SPACE = "no_space"
"""A new block could not be stored: every block in the pool is referenced."""


def layout_seed(model_id: str, dtype: str, layout: str, weights: str = "dense") -> bytes:
    """The root of every chain: a block made for another model, dtype, layout or weight format (``dense``,
    ``int4[q4_1,q8_0]``: LlamaRunner.weight_format) never matches."""
    return xxhash.xxh3_128_digest(f"switchboard-kv/1|{model_id}|{dtype}|{layout}|{weights}".encode())


def _token_bytes(ids: Sequence[int]) -> bytes:
    a = array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class BlockHasher:
    """Chained xxh3-128 digests over fixed-size token blocks (full blocks only)."""

    def __init__(self, seed: bytes, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.seed = seed
        self.block_size = block_size

    def hashes(self, ids: Sequence[int], salt: str | None = None, public_tokens: int = 0) -> list[bytes]:
        """One digest per full block of `ids`. Blocks wholly inside the first `public_tokens`
        tokens are unsalted (shared by every tenant); `salt` enters the chain at the first
        block past them, so every later digest depends on it."""
        b = self.block_size
        salt_bytes = xxhash.xxh3_128_digest(b"salt|" + salt.encode()) if salt else b""
        out: list[bytes] = []
        parent = self.seed
        salted = not salt_bytes
        for start in range(0, len(ids) - b + 1, b):
            data = parent
            if not salted and start + b > public_tokens:
                data += salt_bytes
                salted = True
            parent = xxhash.xxh3_128_digest(data + _token_bytes(ids[start : start + b]))
            out.append(parent)
        return out


@dataclass
class CacheEvents:
    """What the cache reports (the shard's metrics listener implements these)."""

    on_evict: Callable[[str, int], None] = lambda reason, blocks: None
    on_store: Callable[[int], None] = lambda blocks: None
    on_block_evicted: Callable[[float, float], None] = lambda lifetime_s, idle_s: None
    """A block evicted for capacity: seconds since it was stored, and since it was last used."""
    on_block_reused: Callable[[float], None] = lambda gap_s: None
    """A cached block used again: seconds since its previous use."""


def auto_budget_bytes() -> int:
    """1/16 of physical memory, capped at 1 GiB (the default of --prefix-cache-bytes 0)."""
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(AUTO_BUDGET_CAP, total // AUTO_BUDGET_FRACTION)


class PrefixCache:
    """A byte-bounded pool of KV blocks addressed by chained digests (see the module docstring)."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 budget_bytes: int, events: CacheEvents | None = None, num_blocks: int | None = None) -> None:
        self.block_size = block_size
        self.num_layers = num_layers
        self.block_bytes = 2 * num_layers * kv_heads * block_size * head_dim * torch.finfo(dtype).bits // 8
        self.num_blocks = max(0, budget_bytes // self.block_bytes) if num_blocks is None else num_blocks
        self.mirror: KVMirror | None = None
        """A pipeline's later stages (pipeline.Hops): every copy between the pool and a slot is
        repeated there on their layers' pools, at the same block indices."""
        self.events = events or CacheEvents()
        shape = (kv_heads, self.num_blocks, block_size, head_dim)
        # torch.empty: no page is touched until a block is first written.
        self.k_pool = [torch.empty(shape, dtype=dtype) for _ in range(num_layers if self.num_blocks else 0)]
        self.v_pool = [torch.empty(shape, dtype=dtype) for _ in range(num_layers if self.num_blocks else 0)]
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * self.num_blocks
        self._refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # never-used blocks, popped from the end
        self._lru: OrderedDict[int, None] = OrderedDict()       # unreferenced, cached blocks; oldest first
        self._stored_at = [0.0] * self.num_blocks               # residency (vllm:kv_block_*_seconds)
        self._used_at = [0.0] * self.num_blocks
        self.evictions: dict[str, int] = {EVICT_CAPACITY: 0, EVICT_NO_SPACE: 0}

    # -- queries ---------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def used_blocks(self) -> int:
        return len(self._by_hash)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def probe(self, hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many leading blocks of `hashes` (at most `max_blocks`) are cached."""
        n = 0
        for h in hashes[:max_blocks]:
            if h not in self._by_hash:
                break
            n += 1
        return n

    # -- a sequence's references --------------------------------------------------------------

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """Reference the blocks of `hashes` (all cached: call probe first); return pool indices."""
        idxs = [self._by_hash[h] for h in hashes]
        now = time.monotonic()
        for i in reversed(idxs):  # tail first: the chain's head ends up most recently used
            if self._refs[i] == 0:
                self.events.on_block_reused(now - self._used_at[i])
            self._used_at[i] = now
            self._refs[i] += 1
            self._lru.pop(i, None)
        return idxs

    def release(self, idxs: Sequence[int]) -> None:
        now = time.monotonic()
        for i in reversed(idxs):
            self._used_at[i] = now
            self._refs[i] -= 1
            if self._refs[i] == 0 and self._hash_of[i] is not None:
                self._lru[i] = None
                self._lru.move_to_end(i)

    # -- moving KV ----------------------------------------------------------------------------

    def load(self, idxs: Sequence[int], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: int) -> None:
        """Copy blocks `idxs` into positions 0..len(idxs)*block_size of `slot`."""
        if not idxs:
            return
        load_blocks(self.k_pool, self.v_pool, idxs, k_cache, v_cache, slot, self.block_size)
        if self.mirror is not None:
            self.mirror.load(idxs, slot)

    def store(self, hashes: Sequence[bytes], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: int,
              first_block: int = 0, hold: bool = False) -> list[int]:
        """Keep the blocks of `hashes` (block i = positions i*bs.. of `slot`) from `first_block` on
        that are not cached yet; return the new blocks' indices. With `hold` they come back
        referenced (the caller releases them), else they go straight to the LRU."""
        new: list[tuple[int, int]] = []  # (block number in the sequence, pool index)
        for b in range(first_block, len(hashes)):
            h = hashes[b]
            if h in self._by_hash:
                continue
            idx = self._take()
            if idx is None:
                self.evictions[EVICT_NO_SPACE] += len(hashes) - b
                self.events.on_evict(EVICT_NO_SPACE, len(hashes) - b)
                break
            self._by_hash[h] = idx
            self._hash_of[idx] = h
            self._stored_at[idx] = self._used_at[idx] = time.monotonic()
            new.append((b, idx))
        if not new:
            return []
        store_blocks(self.k_pool, self.v_pool, new, k_cache, v_cache, slot, self.block_size)
        if self.mirror is not None:
            self.mirror.store(new, slot)
        for _, idx in reversed(new):
            if hold:
                self._refs[idx] += 1
            else:
                self._lru[idx] = None
        self.events.on_store(len(new))
        return [i for _, i in new]

    def insert(self, hashes: Sequence[bytes], kv: torch.Tensor) -> list[int]:
        """Keep blocks that arrived from elsewhere (the cache nodes): block j of `hashes` is
        ``kv[j]``, shaped ``[2, layers, kv_heads, block_size, head_dim]`` (K then V; every layer of
        the model: with a pipeline, this pool keeps the first `num_layers` and the mirror passes
        each later stage its own). Blocks already
        cached are skipped; the new ones come back referenced (the caller releases them)."""
        new: list[tuple[int, int]] = []
        for j, h in enumerate(hashes):
            if h in self._by_hash:
                continue
            idx = self._take()
            if idx is None:
                self.evictions[EVICT_NO_SPACE] += len(hashes) - j
                self.events.on_evict(EVICT_NO_SPACE, len(hashes) - j)
                break
            self._by_hash[h] = idx
            self._hash_of[idx] = h
            self._stored_at[idx] = self._used_at[idx] = time.monotonic()
            self._refs[idx] += 1
            new.append((j, idx))
        if not new:
            return []
        src = torch.tensor([j for j, _ in new], dtype=torch.long)
        idxs = [i for _, i in new]
        picked = kv if len(new) == len(kv) else kv.index_select(0, src)
        insert_blocks(self.k_pool, self.v_pool, idxs, picked)
        if self.mirror is not None:  # a pipeline's later stages keep their layers of the blocks
            self.mirror.insert(idxs, picked)
        self.events.on_store(len(new))
        return [i for _, i in new]

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        idx, _ = self._lru.popitem(last=False)
        old = self._hash_of[idx]
        if old is not None:
            del self._by_hash[old]
        self._hash_of[idx] = None
        self.evictions[EVICT_CAPACITY] += 1
        self.events.on_evict(EVICT_CAPACITY, 1)
        now = time.monotonic()
        self.events.on_block_evicted(now - self._stored_at[idx], now - self._used_at[idx])
        return idx

    def clear(self) -> None:
        """Forget every unreferenced block (an operator reset; referenced ones stay)."""
        for idx in list(self._lru):
            h = self._hash_of[idx]
            if h is not None:
                del self._by_hash[h]
            self._hash_of[idx] = None
            self._free.append(idx)
        self._lru.clear()


class KVMirror(Protocol):
    """Where a PrefixCache's copies are repeated (a pipeline's later stages: pipeline.Hops)."""

    def load(self, idxs: Sequence[int], slot: int) -> None: ...

    def store(self, pairs: Sequence[tuple[int, int]], slot: int) -> None: ...

    def insert(self, idxs: Sequence[int], kv: torch.Tensor) -> None:
        """Blocks from the cache nodes into pool blocks `idxs`; `kv` holds every layer of the model,
        ``[n, 2, layers, kv_heads, bs, head_dim]``: each stage keeps its own layers' part."""
        ...

    def gather(self, slot: int, first: int, end: int, out: torch.Tensor, then: Callable[[], None]) -> None:
        """Blocks ``first..end`` of `slot` on the later stages' layers into `out`
        (``[n, 2, layers, kv_heads, bs, head_dim]``, every layer of the model), then `then()`: at once,
        or later (a pipeline with passes in flight: when they are collected)."""
        ...


def insert_blocks(k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], idxs: Sequence[int],
                  kv: torch.Tensor) -> None:
    """Blocks `kv` (``[n, 2, layers, kv_heads, bs, head_dim]``, its first ``len(k_pool)`` layers
    used) into pool blocks `idxs`."""
    dst = torch.tensor(list(idxs), dtype=torch.long)
    for which, pool in enumerate((k_pool, v_pool)):
        for layer in range(len(pool)):
            # kv[:, which, layer]: [n, kv_heads, bs, head_dim] -> the pool's [kv_heads, blocks, bs, head_dim]
            pool[layer].index_copy_(1, dst, kv[:, which, layer].transpose(0, 1))


def copy_out_blocks(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: int, first: int, end: int,
                    block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``first..end`` of `slot` as ``[n, 2, layers, kv_heads, bs, head_dim]`` (a copy), every
    layer of the caches (into the first ones of `out` when given)."""
    n, layers = end - first, len(k_cache)
    if out is None:
        kv_heads, head_dim = k_cache[0].shape[1], k_cache[0].shape[3]
        out = torch.empty((n, 2, layers, kv_heads, block_size, head_dim), dtype=k_cache[0].dtype)
    for which, cache in enumerate((k_cache, v_cache)):
        for layer in range(layers):
            src = cache[layer][slot, :, first * block_size : end * block_size]  # [kv_heads, n*bs, head_dim]
            out[:, which, layer].copy_(src.reshape(src.shape[0], n, block_size, src.shape[2]).transpose(0, 1))
    return out


def load_blocks(k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], idxs: Sequence[int],
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: int, block_size: int) -> None:
    """Pool blocks `idxs` into positions 0..len(idxs)*block_size of `slot`, every layer of the pools."""
    index = torch.tensor(idxs, dtype=torch.long)
    n = len(idxs) * block_size
    for pool, cache in ((k_pool, k_cache), (v_pool, v_cache)):
        for layer in range(len(pool)):
            dst = cache[layer][slot, :, :n]
            # Straight into the slot (out=): a temporary here is a fresh mmap per layer, and its
            # page faults cost ~5 ms per layer-tensor against 13 us (measured on this CPU).
            torch.index_select(pool[layer], 1, index, out=dst.view(dst.shape[0], len(idxs), block_size, dst.shape[2]))


def store_blocks(k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], pairs: Sequence[tuple[int, int]],
                 k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: int, block_size: int) -> None:
    """Block b of `slot` into pool block i for each (b, i) of `pairs` (b ascending), every layer."""
    if not pairs:
        return
    # Runs of consecutive block numbers move with one copy per layer.
    runs: list[list[tuple[int, int]]] = [[pairs[0]]]
    for item in pairs[1:]:
        if item[0] == runs[-1][-1][0] + 1:
            runs[-1].append(item)
        else:
            runs.append([item])
    for run in runs:
        start, n = run[0][0] * block_size, len(run)
        index = torch.tensor([i for _, i in run], dtype=torch.long)
        for pool, cache in ((k_pool, k_cache), (v_pool, v_cache)):
            for layer in range(len(pool)):
                src = cache[layer][slot, :, start : start + n * block_size]
                pool[layer].index_copy_(1, index, src.reshape(src.shape[0], n, block_size, src.shape[2]))

