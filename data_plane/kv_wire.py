"""The KV-block wire format both the shard and the cache node speak: raw tensor bytes, small header.

    frame = encode_frame(BlockHeader(block_hash, model="smollm2", dtype="bfloat16",
                                     layout="llama.L30.kvh3.d64.bs16", shape=(2, 30, 3, 16, 64)), payload)
    header, payload = decode_frame(frame, verify=True)       # KVWireError(reason) if it is not a good block
    body = b"".join(frames); list(split_frames(body))          # many frames back to back in one body

One frame is one prefix-cache block (data_plane/shard/engines/kv_cache.py): the K and V of its
`block_size` tokens in every layer, `shape` = (2, layers, kv_heads, block_size, head_dim),
C order, little-endian, the engine's dtype (bf16 is sent as its raw 16-bit words). Header, all
little-endian::

    magic  "SBKV"        4 bytes
    version              u16   (1)
    flags                u16   (bit 0: sealed; other bits must be 0)
    block hash           16 bytes (the chained xxh3-128 digest naming the whole prefix up to it)
    checksum             u64   xxh3-64 over the header's fields after this one and the payload
    payload length       u64
    ndim, shape[ndim]    u8, u32 x ndim
    model, dtype, layout u16 length + UTF-8 each

Sealed frames (flag bit 0, what shards send by default: data_plane/shard/kv_seal.py) carry an
AES-256-GCM envelope as their payload instead of the raw bytes; the header stays readable (the node
indexes by the hash), and :func:`associated_data` binds it to the ciphertext, so a frame moved
under another hash, scope (tenant salt), model, dtype, layout or shape does not open. The checksum
then covers the ciphertext: it still tells corruption (``checksum``) from tampering (``sealed``).

The consumer (a shard) checks everything before it uses a block: the checksum (end to end: the
cache node stores frames as it got them and does not re-hash them), that the hash is the one it
asked for, and that model, dtype, layout and shape are its own; a frame that fails any of it is
never used (the shard recomputes those tokens and counts the reason). The cache node only parses
the fixed part (:func:`peek_hash`, :func:`split_frames`) to index what it stores.

Pure Python + xxhash (no torch), so the cache node imports it without the engine's weight.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash

MAGIC = b"SBKV"
VERSION = 1
_FIXED = struct.Struct("<4sHH16sQQ")  # magic, version, flags, hash, checksum, payload length
FIXED_BYTES = _FIXED.size
"""Bytes before the variable part of the header (what :func:`peek_hash` reads)."""
MAX_HEADER_BYTES = 4096
HASH_BYTES = 16
CONTENT_TYPE = "application/x-switchboard-kv"
"""The media type of a body of frames back to back."""

REJECT_CHECKSUM = "checksum"
"""The payload or header does not match its checksum (corrupted at rest or on the way)."""
REJECT_LAYOUT = "layout"
"""Made by another model, dtype or KV layout (or another hash than the one asked for)."""
REJECT_MALFORMED = "malformed"
"""Not a frame at all (truncated, wrong magic or version)."""
REJECT_SEALED = "sealed"
"""A sealed frame that does not open here (tampered with, moved to another hash or scope, sealed with
a key this shard lacks), or a plaintext frame where sealed ones are required."""
FLAG_SEALED = 1
AAD_PREFIX = b"switchboard-kv-v1\x00"


class KVWireError(ValueError):
    """A frame that must not be used; `reason` is one of the REJECT_* values (a metric label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    block_hash: bytes
    model: str
    dtype: str
    layout: str
    shape: tuple[int, ...]
    sealed: bool = False
    """The payload is a sealed envelope (flag bit 0), not the raw K/V bytes."""

    def same_kind(self, other: BlockHeader) -> bool:
        """Whether a block with this header may stand in for one described by `other` (hash aside)."""
        return (self.model, self.dtype, self.layout, self.shape) == (other.model, other.dtype, other.layout,
                                                                      other.shape)


def _var_part(h: BlockHeader) -> bytes:
    parts = [struct.pack("<B", len(h.shape)), struct.pack(f"<{len(h.shape)}I", *h.shape)]
    for text in (h.model, h.dtype, h.layout):
        raw = text.encode()
        parts.append(struct.pack("<H", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def encode_frame(header: BlockHeader, payload: bytes | memoryview) -> bytes:
    """One frame: header + `payload` (the block's raw K/V bytes, or a sealed envelope)."""
    if len(header.block_hash) != HASH_BYTES:
        raise ValueError("block hash must be 16 bytes")
    var = _var_part(header)
    digest = xxhash.xxh3_64()
    digest.update(struct.pack("<Q", len(payload)))
    digest.update(var)
    digest.update(payload)
    fixed = _FIXED.pack(MAGIC, VERSION, FLAG_SEALED if header.sealed else 0, header.block_hash,
                        digest.intdigest(), len(payload))
    return b"".join((fixed, var, payload))


def encode_frame_with(header: BlockHeader, payload_len: int, fill: Callable[[memoryview], None]) -> bytearray:
    """One frame whose payload `fill` writes in place (``payload_len`` bytes): sealing straight into
    the frame's buffer costs no copy of the block."""
    if len(header.block_hash) != HASH_BYTES:
        raise ValueError("block hash must be 16 bytes")
    var = _var_part(header)
    start = FIXED_BYTES + len(var)
    buf = bytearray(start + payload_len)
    view = memoryview(buf)
    view[FIXED_BYTES:start] = var
    fill(view[start:])
    digest = xxhash.xxh3_64()
    digest.update(struct.pack("<Q", payload_len))
    digest.update(view[FIXED_BYTES:])
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, FLAG_SEALED if header.sealed else 0, header.block_hash,
                     digest.intdigest(), payload_len)
    return buf


def associated_data(header: BlockHeader, scope: str) -> bytes:
    """What a sealed frame's ciphertext is bound to: its block hash, shape, model, dtype and layout,
    and `scope` (the tenant salt the block's hash chain was made under, "" for shared blocks)."""
    raw = scope.encode()
    return b"".join((AAD_PREFIX, header.block_hash, _var_part(header), struct.pack("<H", len(raw)), raw))


def _parse(view: memoryview, offset: int) -> tuple[BlockHeader, int, int, int, int]:
    """(header, checksum, var start, payload start, frame end) of the frame at `offset`."""
    if len(view) - offset < FIXED_BYTES:
        raise KVWireError(REJECT_MALFORMED, "truncated frame header")
    magic, version, flags, block_hash, checksum, length = _FIXED.unpack_from(view, offset)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_SEALED:
        raise KVWireError(REJECT_MALFORMED, "not a KV frame (magic, version or flags)")
    pos = var_start = offset + FIXED_BYTES
    try:
        (ndim,) = struct.unpack_from("<B", view, pos)
        shape = struct.unpack_from(f"<{ndim}I", view, pos + 1)
        pos += 1 + 4 * ndim
        texts = []
        for _ in range(3):
            (n,) = struct.unpack_from("<H", view, pos)
            texts.append(bytes(view[pos + 2 : pos + 2 + n]).decode())
            pos += 2 + n
    except (struct.error, UnicodeDecodeError):
        raise KVWireError(REJECT_MALFORMED, "malformed frame header") from None
    if pos - offset > MAX_HEADER_BYTES or pos + length > len(view):
        raise KVWireError(REJECT_MALFORMED, "truncated frame")
    header = BlockHeader(bytes(block_hash), texts[0], texts[1], texts[2], tuple(shape), bool(flags & FLAG_SEALED))
    return header, checksum, var_start, pos, pos + length


def decode_frame(frame: bytes | memoryview, *, verify: bool = True) -> tuple[BlockHeader, memoryview]:
    """The header and payload of one whole frame; with `verify` the checksum is checked."""
    view = memoryview(frame)
    header, checksum, var_start, start, end = _parse(view, 0)
    if end != len(view):
        raise KVWireError(REJECT_MALFORMED, "trailing bytes after the frame")
    payload = view[start:end]
    if verify:
        digest = xxhash.xxh3_64()
        digest.update(struct.pack("<Q", len(payload)))
        digest.update(view[var_start:start])
        digest.update(payload)
        if digest.intdigest() != checksum:
            raise KVWireError(REJECT_CHECKSUM, "block checksum mismatch")
    return header, payload


def split_frames(body: bytes | memoryview) -> Iterator[memoryview]:
    """Each whole frame of a body of frames back to back (KVWireError on a malformed one)."""
    view = memoryview(body)
    offset = 0
    while offset < len(view):
        _, _, _, _, end = _parse(view, offset)
        yield view[offset:end]
        offset = end


def peek_hash(frame: bytes | memoryview) -> bytes:
    """The block hash a frame claims (no checksum check: that is the consumer's job)."""
    view = memoryview(frame)
    if len(view) < FIXED_BYTES or bytes(view[:4]) != MAGIC:
        raise KVWireError(REJECT_MALFORMED, "not a KV frame")
    return bytes(view[8:24])


_LINKS = struct.Struct("<4sI")
LINKS_MAGIC = b"SBKL"


def encode_put(links: list[bytes], frames: list[bytes | bytearray]) -> bytes:
    """A store request's body: the hashes of blocks the session already has stored (linked, not
    re-sent), then the new frames."""
    return b"".join((_LINKS.pack(LINKS_MAGIC, len(links)), *links, *frames))


def decode_put(body: bytes | memoryview) -> tuple[list[bytes], list[memoryview]]:
    """(links, frames) of a store request's body (KVWireError when malformed)."""
    view = memoryview(body)
    if len(view) < _LINKS.size:
        raise KVWireError(REJECT_MALFORMED, "truncated store request")
    magic, n = _LINKS.unpack_from(view, 0)
    end = _LINKS.size + n * HASH_BYTES
    if magic != LINKS_MAGIC or end > len(view):
        raise KVWireError(REJECT_MALFORMED, "malformed store request")
    links = [bytes(view[i : i + HASH_BYTES]) for i in range(_LINKS.size, end, HASH_BYTES)]
    return links, list(split_frames(view[end:]))


def split_hashes(body: bytes | memoryview) -> list[bytes]:
    """A fetch request's body: 16-byte block hashes back to back, in prefix order."""
    if len(body) % HASH_BYTES:
        raise KVWireError(REJECT_MALFORMED, "a fetch body is whole 16-byte hashes")
    view = memoryview(body)
    return [bytes(view[i : i + HASH_BYTES]) for i in range(0, len(view), HASH_BYTES)]
