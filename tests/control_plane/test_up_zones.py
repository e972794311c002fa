"""`switchboard up --zones a,b`: two zones' worth of processes on one machine, one gateway per zone.

    .venv/bin/python -m pytest tests/control_plane/test_up_zones.py -q      # ~20 s
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import openai

from tests.support.metrics import scrape, up_headers
from tests.support.procs import free_port, free_port_pair, start_up, wait_up


def _value(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_up_with_two_zones_keeps_traffic_and_free_sessions_local(tmp_path: Path) -> None:
    gw, cp = free_port_pair(), free_port()
    proc = start_up(tmp_path, "--engine", "synthetic", "--gateway-port", str(gw), "--control-plane-port", str(cp),
                    "--zones", "a,b", "--no-console")
    try:
        banner = wait_up(proc, tmp_path)
        assert f"http://127.0.0.1:{gw + 1}/v1" in banner and "zone b" in banner
        creds = json.loads((tmp_path / ".switchboard" / "credentials.json").read_text())
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}
        scraper = up_headers(tmp_path / ".switchboard")
        members = httpx.get(f"http://127.0.0.1:{cp}/admin/v1/members", headers=admin).json()["members"]
        by_service: dict[str, set[str]] = {}
        for m in members:
            by_service.setdefault(m["service"], set()).add(m["zone"])
        assert by_service == {"shard": {"a", "b"}, "cache": {"a", "b"}, "gateway": {"a", "b"}}, members
        zones = httpx.get(f"http://127.0.0.1:{cp}/admin/v1/zones", headers=admin).json()
        assert [z["state"] for z in zones["zones"]] == ["up", "up"]
        caches = {m["zone"]: m["url"] for m in members if m["service"] == "cache"}

        for zone, port in (("a", gw), ("b", gw + 1)):
            before = {z: _value(scrape(u, scraper), "switchboard_cache_entries") for z, u in caches.items()}
            free = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=creds["keys"]["free"], max_retries=0)
            for i in range(4):
                out = free.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": f"hi {i}"}],
                                                   extra_headers={"X-Session-Id": "new"})
                assert out.choices[0].message.content
            after = {z: _value(scrape(u, scraper), "switchboard_cache_entries") for z, u in caches.items()}
            # a free session (one replica) lives in the zone of the gateway that made it
            assert after[zone] - before[zone] == 4 and all(after[z] == before[z] for z in caches if z != zone)
            metrics = scrape(f"http://127.0.0.1:{port}", scraper)
            assert _value(metrics, "switchboard_router_zone_decisions_total", locality="local") >= 4
            assert _value(metrics, "switchboard_router_zone_decisions_total", locality="remote") == 0

        plus = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key=creds["keys"]["plus"], max_retries=0)
        before = {z: _value(scrape(u, scraper), "switchboard_cache_entries") for z, u in caches.items()}
        plus.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "paid"}],
                                     extra_headers={"X-Session-Id": "new"})
        after = {z: _value(scrape(u, scraper), "switchboard_cache_entries") for z, u in caches.items()}
        assert all(after[z] - before[z] == 1 for z in caches)  # one replica in each zone
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0 or proc.returncode in (0, -signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
