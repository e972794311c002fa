"""Revoking an API key by removing it from the gateway's keys file (docs/runbook.md) takes effect
without a restart (data_plane/gateway/keys_file.py); a broken edit keeps the keys in force."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.support.procs import Service
from tests.support.waits import eventually

KEEP, REVOKE, ADDED = "sk-test-keep-0001", "sk-test-revoke-0002", "sk-test-added-0003"


def _write(path: Path, *keys: str) -> None:
    """Written beside and renamed over, as editors and config managers do (a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("keys:\n" + "".join(f"- {{key: {k}, tenant: t, tier: free}}\n" for k in keys))
    os.replace(tmp, path)


def _status(gw: Service, key: str) -> int:
    return httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code


def test_a_key_removed_from_the_keys_file_stops_working_and_a_bad_edit_changes_nothing(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    _write(keys, KEEP, REVOKE)
    with Service(["gateway", "--keys-file", str(keys), "--cache-urls", "http://127.0.0.1:1"]) as gw:
        assert (_status(gw, KEEP), _status(gw, REVOKE), _status(gw, ADDED)) == (200, 200, 401)
        _write(keys, KEEP, ADDED)
        eventually(lambda: _status(gw, REVOKE) == 401, timeout_s=10, detail=gw.log_tail)
        assert (_status(gw, KEEP), _status(gw, ADDED)) == (200, 200)

        def refused() -> int:
            return gw.log_tail(50_000).count("was not loaded")

        for broken in ("keys: [{key: sk-x, tenant: t, tier: no-such-tier}]\n", "keys: [ {key: "):  # a bad tier, half a file
            before = refused()
            bad = tmp_path / "bad.yaml"
            bad.write_text(broken)
            os.replace(bad, keys)
            eventually(lambda n=before: refused() > n, timeout_s=10, detail=gw.log_tail)
            assert (_status(gw, KEEP), _status(gw, ADDED), _status(gw, REVOKE)) == (200, 200, 401)  # nobody locked out
