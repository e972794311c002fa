"""The credentials `switchboard up` makes: digests on the server's side, the keys only on the client's.

    creds = prepare(Path(".switchboard"))     # at every `up`, before any child starts
    creds["keys"]                             # {tier: key}: the dev keys the keys file still accepts
    creds["minted"]                           # True when they were made now: the banner shows them this once

Why: the gateway's keys file (``keys.yaml``) is the server's store of who may call. It used to hold the
dev keys in plaintext, so anything that read the state dir (a backup, a support bundle, a misplaced
mount) held working keys, against the rule that nothing secret is at rest in plain text. It now holds
only each key's SHA-256 (the gateway's ``key_sha256`` entries, as ``switchboard keys create`` writes).

Someone must still hold the keys themselves: the operator who runs `up` is the dev keys' client (the
banner, the console's Playground, ``bench tiers``, the README's ``curl``). They go to
``credentials.json`` beside it, a *client* credential like ``~/.netrc`` or ``~/.aws/credentials``:
mode 600 in a mode-700 folder, written whole to a temporary file and renamed over the old one (no
moment where it exists half-written or readable by others), never read by a server process. The banner
prints the keys in full only on the run that made them; later runs print their key ids (the first hex
digits of the digest, as logs and the ledger show them) and where the keys are.

The keys file is the truth: a dev key revoked from it (``switchboard keys revoke``) is not brought back,
is no longer offered by the Playground, and disappears from ``credentials.json`` at the next `up`. A
keys file from before this change, with dev keys in plaintext, is rewritten with digests at the next
`up` (its keys keep working: they move to ``credentials.json``). Another tenant's plaintext entry is the
operator's own and is left alone (``switchboard keys list`` flags it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import yaml

from data_plane.gateway.auth import DEV_TENANT, KEY_ID_LENGTH, generate_key, key_digest
from data_plane.gateway.keys_edit import append_entry, locked, read_keys_file, remove_entries, write_atomic

log = logging.getLogger(__name__)

TIERS = ("free", "plus", "enterprise")
"""One dev key per tier of the built-in policy."""
KEY_PATTERN = re.compile(r"sk-sb-[A-Za-z0-9_-]{43}")
"""A dev key as `generate_key` makes it (32 random bytes, URL-safe base64), for reading a damaged file."""
HEADER = ("# Gateway API keys (switchboard keys create / list / revoke): SHA-256 digests only.\n"
          "# The dev keys `switchboard up` made are in credentials.json beside this file (a client credential).\n")


def secret(path: Path, prefix: str) -> str:
    """A token made once (mode 600) and reused on every later run."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(prefix + secrets.token_urlsafe(32))
    return path.read_text().strip()


def session_keys(path: Path) -> Path:
    """The key that encrypts session transcripts and (through shards, data_plane/shard/kv_seal.py) KV blocks at
    rest, made once (mode 600). To rotate: put a new line first
    (`python -c "from data_plane.common.crypto import new_key_line as k; print(k('k2'))"`), keep the old line
    below it until old sessions have expired."""
    if not path.exists():
        from data_plane.common.crypto import new_key_line

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# session transcript and KV block keys: '<key id> <base64 32 bytes>', the first seals\n"
                    + new_key_line("k" + time.strftime("%Y%m%d")) + "\n")
    return path


def _entry(tier: str, key: str) -> dict[str, Any]:
    return {"key_sha256": key_digest(key), "tenant": DEV_TENANT, "tier": tier, "name": f"dev-{tier}"}


def _create(path: Path, tiers: tuple[str, ...]) -> dict[str, str] | None:
    """Make the keys file with a digest per new key; None when another process made it first (concurrent
    callers agree on one file: it appears whole, or not at all)."""
    keys = {tier: generate_key() for tier in tiers}
    path.parent.mkdir(parents=True, exist_ok=True)
    text = HEADER + yaml.safe_dump({"keys": [_entry(t, k) for t, k in keys.items()]}, sort_keys=False, width=1000)
    return keys if write_atomic(path, text, exclusive=True) else None


def _digest_dev_entries(path: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The keys file's entries, after its plaintext dev keys were replaced by their digests (a file from
    before digests); returns the entries and ``{digest: key}`` of the keys moved out of it."""
    with locked(path):
        text, entries = read_keys_file(path)
        plain = {i: e for i, e in enumerate(entries) if "key" in e and e.get("tenant") == DEV_TENANT}
        if not plain:
            return entries, {}
        moved = {key_digest(str(e["key"])): str(e["key"]) for e in plain.values()}
        new = remove_entries(text, set(plain))
        for e in plain.values():
            new = append_entry(new, {**_entry(str(e["tier"]), str(e["key"])),
                                     **({"name": e["name"]} if e.get("name") else {})})
        checked = _validated(new, path)
        write_atomic(path, new)
        log.warning("%s: %d dev key(s) were stored in plaintext; now only their digests are (the keys are in "
                    "credentials.json)", path, len(moved))
        return checked, moved


def _validated(text: str, path: Path) -> list[dict[str, Any]]:
    """`text`'s entries, validated as the gateway would load them (ValueError naming `path`, never a key)."""
    from data_plane.common.yaml_source import parse_yaml
    from data_plane.gateway.auth import KeyStore

    data = parse_yaml(text, str(path))
    KeyStore.from_dict(data, where=str(path))
    return [dict(e) for e in (data or {}).get("keys") or []]


def dev_keys(path: Path, remembered: dict[str, str], tiers: tuple[str, ...] = TIERS) -> tuple[dict[str, str], bool]:
    """``({tier: key}, minted)``: new keys (and a new keys file of their digests) when there is no keys file;
    else, of the keys `remembered` (the last credentials file) and any plaintext dev key the file held, the
    first per tier whose digest the file still lists under that tier. A tier with none is left out: a dev
    key revoked from the file stays revoked."""
    if not path.exists():
        made = _create(path, tiers)
        if made is not None:
            return made, True
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("API keys file %s is readable by others (mode %o); chmod 600 it", path, mode)
    entries, moved = _digest_dev_entries(path)
    plain = [e for e in entries if "key" in e]
    if plain:
        log.warning("%s holds %d key(s) of other tenants in plaintext: `switchboard keys list` names them; "
                    "revoke and re-create them to keep only digests", path, len(plain))
    live = {str(e.get("key_sha256") or key_digest(str(e.get("key", "")))).lower(): e.get("tier") for e in entries}
    found: dict[str, str] = {}
    for key in [*moved.values(), *remembered.values()]:
        tier = live.get(key_digest(key))
        if tier in tiers and tier not in found:
            found[str(tier)] = key
    return {tier: found[tier] for tier in tiers if tier in found}, False


def _remembered(path: Path) -> dict[str, str]:
    """The keys the last credentials file held (``{}`` when there is none). One that does not parse (a
    disk that filled, a hand edit) is moved aside to ``credentials.json.corrupt`` and the dev keys are read
    out of its text: `dev_keys` takes only those the keys file lists. It used to be read as no keys and
    written over, and the keys file holds digests only: the dev keys were gone for good, and the banner
    said none was left in the keys file, which still accepted all three."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    try:
        keys = json.loads(text).get("keys")
    except (ValueError, AttributeError):
        aside = path.with_name(path.name + ".corrupt")
        with contextlib.suppress(OSError):
            os.replace(path, aside)  # mode 600 kept: it may hold the keys and the admin token
        found = {f"salvaged-{i}": key for i, key in enumerate(dict.fromkeys(KEY_PATTERN.findall(text)))}
        log.warning("%s did not parse (moved to %s); %d dev key(s) read out of it", path, aside, len(found))
        return found
    return {str(t): str(k) for t, k in keys.items()} if isinstance(keys, dict) else {}


def write_client_credentials(path: Path, creds: dict[str, Any]) -> None:
    """The client credentials file: mode 600, whole or not at all (keys_edit.write_atomic)."""
    write_atomic(path, json.dumps(creds, indent=2) + "\n")


def prepare(state: Path) -> dict[str, Any]:
    """Every credential `up` hands out, made where missing, and the client credentials file written.
    ``minted`` and ``admin_minted`` (not written to the file) say the keys, the admin token, were made now."""
    path = state / "credentials.json"
    with locked(path):  # two `up`s at once: the second reads the keys the first made, never writes {} over them
        keys, minted = dev_keys(state / "keys.yaml", _remembered(path))
        admin_minted = not (state / "admin_token").exists()
        creds: dict[str, Any] = {
            "keys": keys, "admin_token": secret(state / "admin_token", "sb-admin-"),
            # what a shard or cache node started by hand needs to join (SWITCHBOARD_CLUSTER_TOKEN)
            "cluster_token": secret(state / "cluster_token", "sb-cluster-"),
            # /metrics only (SWITCHBOARD_METRICS_TOKEN): what `--prometheus` scrapes with, or your own Prometheus
            "metrics_token": secret(state / "metrics_token", "sb-metrics-"),
            "session_keys_file": str(session_keys(state / "session_keys"))}
        write_client_credentials(path, creds)
    return {**creds, "minted": minted, "admin_minted": admin_minted}


def record_urls(state: Path, **urls: str) -> None:
    """Where this `up` serves (``control_plane_url``, ``gateway_url``), added to its client credentials
    file: `switchboard admin` run from the same folder then finds a control plane started on another port
    (`up --control-plane-port`), as it finds the admin token there."""
    path = state / "credentials.json"
    with locked(path):
        try:
            creds = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(creds, dict):
            write_client_credentials(path, {**creds, **urls})


def key_id(key: str) -> str:
    """The key's public id, as gateway logs, `switchboard keys list` and the usage ledger show it."""
    return key_digest(key)[:KEY_ID_LENGTH]


__all__ = ["TIERS", "dev_keys", "key_id", "prepare", "secret", "session_keys", "write_client_credentials"]
