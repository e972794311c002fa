"""A tier added to the control plane's hot policy (the console's tier editor, PUT /admin/v1/tiers) and a
key made for it in the gateway's keys file: the gateway serves it, later edits of the file still apply,
and a restarted gateway starts.

Why: the keys file's reload checked every key's tier against the policy the gateway *started* with. A key
of the new tier made the whole file "not loaded": every later revocation silently stayed unapplied (the
revoked key answered 200), and the next gateway start refused ("API keys name unknown tiers"), a
crash loop under `switchboard up`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from data_plane.gateway.auth import generate_key, key_digest
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import Service
from tests.support.waits import eventually


def keys_yaml(keys: dict[str, str]) -> str:
    """A keys file of digests: {key: tier}, one tenant per tier."""
    lines = ["keys:"]
    for key, tier in keys.items():
        lines += [f"- key_sha256: {key_digest(key)}", f"  tenant: t-{tier}", f"  tier: {tier}"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def control_plane(tmp_path: Path) -> Iterator[tuple[Service, httpx.Client, list[Service]]]:
    """A real control plane, its admin client, and the list of services stopped at the end (append yours)."""
    cp = Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0", "--state-dir", str(tmp_path)])
    services = [cp]
    try:
        cp.start()
        with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10) as admin:
            yield cp, admin, services
    finally:
        for svc in reversed(services):
            svc.stop()


def add_gold(admin: httpx.Client) -> dict:
    """Add tier 'gold' (plus's limits) to the control plane's policy; the policy as it was."""
    tiers: dict = admin.get("/admin/v1/tiers").json()["tiers"]
    assert admin.put("/admin/v1/tiers", json={"tiers": {**tiers, "gold": {**tiers["plus"], "shed_order": 3}}}
                     ).status_code == 200
    return tiers


def test_a_key_of_a_tier_added_on_the_control_plane(tmp_path: Path) -> None:
    plus, gold = generate_key(), generate_key()
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(keys_yaml({plus: "plus"}))
    with control_plane(tmp_path) as (cp, admin, services):
        gateway_args = ["gateway", "--registry-url", cp.url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                        "--keys-file", str(keys_file)]
        shard = Service(["shard", "--engine", "synthetic", "--registry-url", cp.url, "--node-id", "shard-0"])
        gateway = Service(gateway_args)
        services += [shard, gateway]
        shard.start()
        gateway.start()
        add_gold(admin)

        def chat(key: str) -> int:
            return httpx.post(gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                              timeout=10).status_code

        eventually(lambda: "gold" in gateway.log_tail(20_000), 5.0)  # the gateway has the new policy
        keys_file.write_text(keys_yaml({plus: "plus", gold: "gold"}))
        eventually(lambda: chat(gold) == 200, 5.0)
        keys_file.write_text(keys_yaml({gold: "gold"}))  # revoke plus: it must stop working
        eventually(lambda: chat(plus) == 401, 5.0)

        gateway.stop()  # a restart: the keys file names 'gold', which only the control plane's policy has
        gateway = Service(gateway_args)
        services[-1] = gateway
        gateway.start()
        eventually(lambda: chat(gold) == 200, 5.0)
        assert chat(plus) == 401


def test_a_revocation_applies_while_a_key_names_a_tier_removed_on_the_control_plane(tmp_path: Path) -> None:
    """The reload was checked against the gateway's own tiers and the policy in force: once a tier was
    removed on the console (or before a restarted gateway saw the control plane's policy), a key of it
    left in the file made every later version of the file 'not loaded', so a key removed from it (a
    revocation) went on answering. Such a key is refused when used (403 tier_removed), the rest applies."""
    plus, gold = generate_key(), generate_key()
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(keys_yaml({plus: "plus"}))
    with control_plane(tmp_path) as (cp, admin, services):
        gateway = Service(["gateway", "--registry-url", cp.url, "--tokenizer", "whitespace", "--model-name",
                           "synthetic", "--keys-file", str(keys_file)])
        services.append(gateway)
        gateway.start()

        def models(key: str) -> int:
            return httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=10).status_code

        tiers = add_gold(admin)
        keys_file.write_text(keys_yaml({plus: "plus", gold: "gold"}))
        eventually(lambda: models(gold) == 200, 5.0)
        assert admin.put("/admin/v1/tiers", json={"tiers": tiers}).status_code == 200  # gold removed
        eventually(lambda: models(gold) == 403, 5.0)
        keys_file.write_text(keys_yaml({gold: "gold"}))  # revoke plus: it must stop working
        eventually(lambda: models(plus) == 401, 5.0)
        assert models(gold) == 403
