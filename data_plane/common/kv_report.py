"""The wire of a shard's prefix-cache reports to routers: three HTTP headers on the chat hop.

    headers[SINCE_HEADER] = "41"                       # gateway -> shard: the last report it has seen
    # shard -> gateway, on the response's headers (sent before the first token):
    CHAIN_HEADER:   "9f1c2a7b03de4411:1536"            # the prompt's last full block (chain id), prompt tokens
    EVICTED_HEADER: "44;0a1b2c3d4e5f6071,77aa..."      # newest report number; chain ids evicted since 41
    format_evicted(44, ["0a1b2c3d4e5f6071"]); parse_evicted("44;0a1b...") -> (44, ["0a1b..."])

A chain id is the first 8 bytes (hex) of the prefix-cache digest of the prompt's last full
16-token block (data_plane/shard/engines/kv_cache.py): it names the whole prefix, salt included.
The shard (data_plane/shard/kv_reports.py) remembers the chain ids it announced and reports one when
that block is evicted; the gateway's router (data_plane/routing/kv_routing.py) maps it back to the
session and forgets that shard as the session's KV holder. Both sides import only this module.
"""

from __future__ import annotations

SINCE_HEADER = "x-switchboard-kv-since"
CHAIN_HEADER = "x-switchboard-kv-chain"
EVICTED_HEADER = "x-switchboard-kv-evicted"
MAX_REPORTED = 64
"""Chain ids one response carries at most (about 1.1 KB of header)."""
CHAIN_BYTES = 8


def chain_id(digest: bytes) -> str:
    return digest[:CHAIN_BYTES].hex()


def format_chain(chain: str, prompt_tokens: int) -> str:
    return f"{chain}:{prompt_tokens}"


def parse_chain(value: str | bytes | None) -> tuple[str, int] | None:
    """``"9f1c...:1536"`` -> ``("9f1c...", 1536)``; None for anything malformed."""
    if not value:
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    chain, _, tokens = text.partition(":")
    if len(chain) != 2 * CHAIN_BYTES or not tokens.isdigit():
        return None
    return chain, int(tokens)


def format_evicted(seq: int, chains: list[str]) -> str:
    return f"{seq};{','.join(chains[-MAX_REPORTED:])}"


def parse_evicted(value: str | bytes | None) -> tuple[int, list[str]] | None:
    """``"44;a,b"`` -> ``(44, ["a", "b"])``; None for anything malformed (a report is advisory)."""
    if not value:
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    seq, _, chains = text.partition(";")
    if not seq.isdigit():
        return None
    found = [c for c in chains.split(",") if len(c) == 2 * CHAIN_BYTES][:MAX_REPORTED]
    return int(seq), found
