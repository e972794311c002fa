"""A key's lifecycle from a shell: `switchboard keys create`, use it, `switchboard keys set-tier` (the same key
under another tier's limits, at once), `switchboard keys revoke`; its usage stays attributed after it is gone.

Before `set-tier`, moving a key to another tier meant editing keys.yaml by hand, or revoking the key and
issuing a new one, which every app holding it had to be given."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest

from data_plane.gateway.auth import KeyStore
from data_plane.gateway.keys_cli import main
from data_plane.tiers import TierPolicy
from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.waits import eventually

FILE = ("# Gateway API keys\nkeys:\n# who: the acme ci bot\n- key_sha256: " + "ab" * 32
        + "\n  tenant: acme\n  tier: plus   # since the pilot\n  name: ci\n- key_sha256: " + "cd" * 32
        + "\n  tenant: acme\n  tier: free\n")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_set_tier_changes_only_that_field_and_keeps_comments(tmp_path: Path, capsys) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    code, out, err = _run(capsys, "set-tier", "--keys-file", str(path), "--digest", "ababab", "--tier", "enterprise")
    assert code == 0, err
    assert out.strip() == f"{'ab' * 6}  tenant acme  tier plus -> enterprise"
    assert path.read_text() == FILE.replace("tier: plus   #", "tier: enterprise   #")  # in place, comments kept
    KeyStore.from_yaml(path)  # still a keys file the gateway loads
    code, _, err = _run(capsys, "set-tier", "--keys-file", str(path), "--tenant", "acme", "--tier", "platinum")
    assert code == 2 and "unknown tier 'platinum'" in err
    code, _, err = _run(capsys, "set-tier", "--keys-file", str(path), "--digest", "eeeeee", "--tier", "free")
    assert code == 1 and "no key id starts with eeeeee" in err
    code, _, err = _run(capsys, "set-tier", "--keys-file", str(path), "--digest", "ababab")
    assert code == 2 and "--tier" in err
    assert path.read_text() == FILE.replace("tier: plus   #", "tier: enterprise   #")  # refusals change nothing
    code, _, _ = _run(capsys, "set-tier", "--keys-file", str(path), "--tenant", "acme", "--tier", "free")
    assert code == 0 and path.read_text().count("tier: free") == 2 and "# who: the acme ci bot" in path.read_text()


def test_a_key_created_used_re_tiered_and_revoked_from_a_shell(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(FILE)
    policy = TierPolicy.default()
    with Cluster(shards=1, caches=1, gateway_args=["--keys-file", str(keys)]) as cluster:
        code, out, err = _run(capsys, "create", "--keys-file", str(keys), "--tenant", "opsco", "--tier", "free")
        assert code == 0, err
        key = out.strip()
        key_id = hashlib.sha256(key.encode()).hexdigest()[:12]

        def chat() -> httpx.Response:
            return httpx.post(cluster.gateway.url + "/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

        def rpm() -> str | None:
            r = chat()
            return r.headers.get("x-ratelimit-limit-requests") if r.status_code == 200 else str(r.status_code)

        eventually(lambda: rpm() == str(policy.get("free").rpm), timeout_s=10, interval_s=0.3, what="the new key served as free")
        code, _, err = _run(capsys, "set-tier", "--keys-file", str(keys), "--digest", key_id, "--tier", "enterprise")
        assert code == 0, err
        took = eventually(lambda: rpm() == str(policy.get("enterprise").rpm), timeout_s=10, interval_s=0.3,
                          what="the same key under enterprise's limits", detail=cluster.gateway.log_tail)
        assert took < 5
        code, _, err = _run(capsys, "revoke", "--keys-file", str(keys), "--digest", key_id)
        assert code == 0, err
        took = eventually(lambda: chat().status_code == 401, timeout_s=10, interval_s=0.3, what="the revoked key refused")
        assert took < 5
        # its requests stay in the ledger under its id, each under the tier it was served in
        admin = httpx.Client(base_url=cluster.control_plane.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

        def tiers() -> dict[str, int]:
            rows = admin.get("/admin/v1/usage", params={"key": key_id, "by": "tier", "group_by": "none",
                                                       "start": time.time() - 600}).json()["rows"]
            return {r["tier"]: r["requests"] for r in rows}

        eventually(lambda: set(tiers()) == {"free", "enterprise"}, timeout_s=15, what="the key's usage by tier")
        assert all(n >= 1 for n in tiers().values())
