"""KV blocks sealed at rest: the shard seals each KV frame before it leaves for a cache node and opens
it after a fetch, so cache nodes (memory or Redis) only ever hold ciphertext.

    keys = kv_keyring(keys_file=settings.kv_keys_file, keys_env=settings.kv_keys, cluster_token=tok)
    sealer = KVSealer(keys, metrics.kv_tier)                       # data_plane/shard/kv_tier.py holds it
    frame = sealer.seal_frame(header, raw_kv, scope="tenant:acme")  # header.sealed is set on the frame
    sealer.open_into(header, payload, scope, out)                   # KVWireError("sealed") if it does not open
    scopes = block_scopes(len(hashes), 16, salt, public_tokens)     # the scope of each block of a chain

A shared KV block reveals a conversation about as well as its transcript (which the gateway seals:
data_plane/common/crypto.py), so it gets the same protection: AES-256-GCM with keys from the same
:class:`~data_plane.common.crypto.Keyring` mechanism (first key seals, every listed key opens). The
keys file may be the gateway's; KV keys are derived from it with their own HKDF label, and from the
cluster token with another label than transcripts, so transcript and KV keys always differ.

Each frame gets its own AES key, HMAC-SHA256(KV root key, random 16-byte salt), and a random 96-bit
nonce: KV blocks are sealed by the thousand per second fleet-wide, and one AES-GCM key with random
nonces is good for 2^32 messages only. The associated data (data_plane/kv_wire.py
:func:`~data_plane.kv_wire.associated_data`) binds the block hash, model, dtype, layout, shape and
the block's scope (the tenant salt its hash chain was made under; "" for operator-marked public
blocks, which every tenant shares): a frame copied under another hash or tenant fails to open, and
the shard treats that exactly like a checksum failure (recompute, counted as ``sealed``).

Envelope (the frame's payload)::

    kid length u8, kid, salt 16 bytes, nonce 12 bytes, ciphertext (as long as the raw block), tag 16 bytes
"""

from __future__ import annotations

import hmac
import logging
import os
import struct
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from data_plane.common.crypto import KEY_BYTES, NONCE_BYTES, Keyring
from data_plane.kv_wire import REJECT_SEALED, BlockHeader, KVWireError, associated_data, encode_frame_with
from data_plane.shard.kv_metrics import KVTierMetrics

log = logging.getLogger(__name__)

KV_KEYS_ENV = "SWITCHBOARD_SHARD_KV_KEYS"
"""``kid:base64,kid:base64`` (first seals): the shard's KV keys when no keys file is given."""
KV_KEY_INFO = b"switchboard kv blocks v1"
"""HKDF info: the KV root key from a keyring key, and the KV keyring from the cluster token."""
FRAME_KEY_LABEL = b"switchboard kv frame key v1\x00"
SALT_BYTES = 16
TAG_BYTES = 16


def kv_keyring(*, keys_file: str | None, keys_env: str | None, cluster_token: str | None) -> Keyring:
    """The shard's KV keys: a keys file, the env value, or derived from the cluster token (KV's own
    HKDF label); else a per-process key (blocks then open only on the shard that sealed them)."""
    return Keyring.from_settings(keys_file=keys_file, keys_env=keys_env, cluster_token=cluster_token,
                                 info=KV_KEY_INFO, env_name=KV_KEYS_ENV,
                                 consequence="KV blocks on the cache nodes open only on this shard "
                                             "(another shard resuming a session recomputes)")


def block_scopes(n: int, block_size: int, salt: str | None, public_tokens: int) -> list[str]:
    """The scope of each of a chain's first `n` blocks, as data_plane/shard/engines/kv_cache.py
    salts them: "" for blocks wholly inside the public prefix (or without a salt), else the salt."""
    return ["" if not salt or (i + 1) * block_size <= public_tokens else salt for i in range(n)]


class KVSealer:
    """Seals and opens KV frames with a keyring's keys (thread-safe: called from worker threads)."""

    def __init__(self, keys: Keyring, metrics: KVTierMetrics) -> None:
        self.keys = keys
        self.metrics = metrics
        self._roots = {kid: HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                                 info=KV_KEY_INFO).derive(key) for kid, key in keys.keys.items()}
        self._kid = keys.current.encode()

    def _aead(self, kid: str, salt: bytes) -> AESGCM:
        return AESGCM(hmac.digest(self._roots[kid], FRAME_KEY_LABEL + salt, "sha256"))

    def sealed_len(self, raw_len: int) -> int:
        return 1 + len(self._kid) + SALT_BYTES + NONCE_BYTES + raw_len + TAG_BYTES

    def seal_frame(self, header: BlockHeader, raw: memoryview, scope: str) -> bytearray:
        """A sealed frame (``header.sealed`` set) of the block's raw K/V bytes `raw`."""
        sealed = BlockHeader(header.block_hash, header.model, header.dtype, header.layout, header.shape, True)
        started = time.perf_counter()
        kid, pre = self._kid, 1 + len(self._kid) + SALT_BYTES + NONCE_BYTES

        def fill(out: memoryview) -> None:
            salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
            out[:pre] = struct.pack("<B", len(kid)) + kid + salt + nonce
            self._aead(self.keys.current, salt).encrypt_into(nonce, raw, associated_data(sealed, scope), out[pre:])

        frame = encode_frame_with(sealed, self.sealed_len(len(raw)), fill)
        m = self.metrics
        m.crypto.labels(m.model_name, "seal", "ok").inc()
        m.crypto_time.labels(m.model_name, "seal").inc(time.perf_counter() - started)
        return frame

    def open_into(self, header: BlockHeader, payload: memoryview, scope: str, out: memoryview) -> None:
        """Decrypt a sealed frame's payload into `out` (the block's raw size); KVWireError("sealed")
        when it does not open: tampered, moved, another key, or not sealed at all."""
        m, started = self.metrics, time.perf_counter()
        if not header.sealed:
            self._failed("plaintext", "a plaintext KV frame where sealed ones are required")
        kid_len = payload[0] if len(payload) else 0
        pre = 1 + kid_len + SALT_BYTES + NONCE_BYTES
        if len(payload) < pre + TAG_BYTES or len(payload) - pre - TAG_BYTES != len(out):
            self._failed("failed", "a sealed KV frame of the wrong size")
        try:
            kid = bytes(payload[1 : 1 + kid_len]).decode()
        except UnicodeDecodeError:
            kid = ""
        if kid not in self._roots:
            self._failed("unknown_key", f"a KV frame sealed with key {kid[:32]!r}, which this shard does not have")
        salt = bytes(payload[1 + kid_len : 1 + kid_len + SALT_BYTES])
        nonce = bytes(payload[pre - NONCE_BYTES : pre])
        try:
            self._aead(kid, salt).decrypt_into(nonce, payload[pre:], associated_data(header, scope), out)
        except InvalidTag:
            self._failed("failed", "a sealed KV frame that does not open for its hash, scope and layout")
        m.crypto.labels(m.model_name, "open", "ok").inc()
        m.crypto_time.labels(m.model_name, "open").inc(time.perf_counter() - started)

    def _failed(self, result: str, message: str) -> None:
        m = self.metrics
        m.crypto.labels(m.model_name, "open", result).inc()
        raise KVWireError(REJECT_SEALED, message)
