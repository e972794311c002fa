"""A small live platform with traffic, for the console's browser check and its screenshots.

    with LivePlatform(tmp_path) as p:           # control plane (autoscaling, local actuator), cache, gateway
        p.traffic(seconds=20)                   # mixed tiers, enough to queue and to hit the free tier's RPM
        console = p.console()                   # `switchboard console` on a free port (Service)

    python -m tests.support.live_platform       # the same, left running for a person: prints the URLs

Shards are started by the control plane's own autoscaler (synthetic engine, 2 batch slots, slow
tokens), so queueing makes it scale out: the Autoscaler page then shows real decisions.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx

from tests.support.cluster import ADMIN_TOKEN, KEYS, api_keys_env
from tests.support.procs import Service

TIER_OF_KEY = {"free": KEYS["free"], "plus": KEYS["plus"], "enterprise": KEYS["enterprise"]}


def console_service(control_plane_url: str, gateway_url: str, credentials: Path, *, refresh_s: float = 3.0,
                    token: str = ADMIN_TOKEN) -> Service:
    """`python -m admin_ui.launch` (what `switchboard console` runs) as a :class:`Service`, not started."""
    return Service(["--control-plane-url", control_plane_url, "--gateway-url", gateway_url,
                    "--credentials-file", str(credentials), "--refresh", str(refresh_s)],
                   module="admin_ui.launch", health="/_stcore/health", ready_timeout=60.0,
                   env={"SWITCHBOARD_ADMIN_TOKEN": token}, log_path=credentials.parent / "console.log")


class LivePlatform:
    def __init__(self, state: Path, *, max_replicas: int = 3) -> None:
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        shard_args = "--engine synthetic --synthetic-token-delay-ms 25 --max-num-seqs 2"
        self.control_plane = Service([
            "control-plane", "--admin-token", ADMIN_TOKEN, "--autoscale", "--actuator", "local",
            "--min-replicas", "1", "--max-replicas", str(max_replicas), "--target-waiting-per-shard", "1",
            "--scale-up-cooldown-s", "4", "--scale-down-cooldown-s", "600", "--autoscale-interval-s", "1",
            "--shard-args", shard_args, "--shard-log-dir", str(state / "logs"), "--signals-window", "10",
            "--degradation-interval", "1", "--ttft-slo-s", "1.5",
        ])
        registry = self.control_plane.url
        self.cache = Service(["cache-node", "--registry-url", registry, "--node-id", "cache-0"])
        self.gateway = Service(["gateway", "--registry-url", registry, "--tokenizer", "whitespace",
                                "--model-name", "synthetic"], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()})
        self.credentials = state / "credentials.json"
        self.credentials.write_text(json.dumps({"keys": TIER_OF_KEY, "admin_token": ADMIN_TOKEN}))
        self.admin = httpx.Client(base_url=registry, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)

    def __enter__(self) -> Self:
        try:
            self.control_plane.start()
            self.cache.start()
            self.gateway.start()
            self.wait_shards(1, 60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.admin.close()
        for s in (self.gateway, self.cache, self.control_plane):
            s.stop()

    def shards_passing(self) -> int:
        members = self.admin.get("/admin/v1/members").json()["members"]
        return sum(1 for m in members if m["service"] == "shard" and m["status"] == "passing")

    def wait_shards(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.shards_passing() >= n:
                return True
            time.sleep(0.3)
        return False

    def console(self, refresh_s: float = 3.0) -> Service:
        return console_service(self.control_plane.url, self.gateway.url, self.credentials, refresh_s=refresh_s)

    def traffic(self, seconds: float, *, workers: int = 8) -> dict[str, int]:
        """Mixed-tier chats for `seconds` from `workers` threads; returns status counts."""
        stop = time.monotonic() + seconds
        counts: dict[str, int] = {}
        lock = threading.Lock()
        tiers = ["free", "free", "plus", "enterprise"]

        def run(i: int) -> None:
            with httpx.Client(base_url=self.gateway.url, timeout=30) as http:
                n = 0
                while time.monotonic() < stop:
                    tier = tiers[(i + n) % len(tiers)]
                    n += 1
                    try:
                        r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {TIER_OF_KEY[tier]}"},
                                      json={"messages": [{"role": "user", "content": f"hello {i} {n}"}],
                                            "max_tokens": 24})
                        key = f"{tier}:{r.status_code}"
                    except httpx.HTTPError as exc:
                        key = f"{tier}:{type(exc).__name__}"
                    with lock:
                        counts[key] = counts.get(key, 0) + 1

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 35)
        return counts


SHOT_PAGES = ["overview", "cluster", "tiers", "autoscaler", "degradation", "alerts"]


def screenshot_tour(console_url: str, out: Path, token: str = ADMIN_TOKEN) -> list[Path]:
    """Screenshots of the main pages, then a Playground chat and its trace's waterfall, logged in with `token`.

    Writes ``out/console-<page>.png``; returns the paths."""
    from admin_ui.screenshot import Chromium, capture_pages, send_chat

    written = capture_pages(console_url, out, SHOT_PAGES, token=token)
    with Chromium(token=token) as browser:
        browser.capture(console_url + "/playground", out / ".playground-empty.png", expect=["Playground"])
        (out / ".playground-empty.png").unlink()
        trace_id = send_chat(browser, "What does Switchboard do?")
        written.append(browser.snapshot(out / "console-playground.png", expect=["Open trace"]))
        written.append(browser.capture(f"{console_url}/traces?trace={trace_id}", out / "console-traces.png",
                                       expect=["Traces", "Updated ", "Waterfall", trace_id[:12]]))
    return written


if __name__ == "__main__":
    import tempfile

    shots = Path(sys.argv[1]) if len(sys.argv) > 1 else None  # python -m tests.support.live_platform docs/img
    with LivePlatform(Path(tempfile.mkdtemp(prefix="sb-console-"))) as p:
        print("traffic:", p.traffic(15), flush=True)
        with p.console() as console:
            print(f"console {console.url}  control plane {p.control_plane.url}  gateway {p.gateway.url}", flush=True)
            background = threading.Thread(target=p.traffic, args=(150 if shots else 10**9,), kwargs={"workers": 4},
                                          daemon=True)
            background.start()
            try:
                if shots:
                    for path in screenshot_tour(console.url, shots):
                        print(path, flush=True)
                else:
                    background.join()
            except KeyboardInterrupt:
                pass
