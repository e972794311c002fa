"""A pipeline stage on another host: stage 1 runs in a network namespace (tests/reliability/netns.py,
one veth link to the root namespace), joins stage 0's group with `switchboard stage --join`, and every
hidden state crosses that link. Real processes, the real model (float32, greedy):

- the shard serves through the remote stage: 8 greedy streams through a gateway (with a plain shard
  beside it) give the same text as before; the per-hop latency over the veth link is read from the
  shard's own metrics and printed (docs/SHARDING.md records it, measured under load);
- the link is cut mid-stream (the host's NIC goes down: packets dropped, nothing refused): the shard
  detects the silent stage within about a second, fails its streams into the gateway's mid-stream
  resume (8/8 complete, identical to the uninterrupted run) and exits; the stranded stage exits too.

Skips (with the reason) where network namespaces cannot be made: not root, no `ip`, no netns support.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.reliability.netns import Hosts
from tests.support.formats import INVARIANT_ARGS
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_TOKEN, ROOT, Service, free_port

pytestmark = pytest.mark.slow

HOSTS = Hosts("sbpp", [1])


@pytest.fixture()
def hosts():
    with HOSTS.up():
        yield HOSTS


def _stage(hosts: Hosts, port: int, log_path: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "control_plane.cli", "stage", "--join", f"{hosts.cp_addr}:{port}", "--rank", "1",
           "--bind", hosts.host_addr(1), "--threads", "1"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(hosts.wrap(1, cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                # the cluster's token, as every stage needs it (pipeline_links.py's handshake)
                                env={**os.environ, "PYTHONPATH": str(ROOT), "SWITCHBOARD_CLUSTER_TOKEN": CLUSTER_TOKEN})


def _hop_ms(url: str, stage: str) -> float:
    name = "switchboard_shard_pipeline_hop_latency_seconds"
    return 1000 * metric(url, name + "_sum", stage=stage) / metric(url, name + "_count", stage=stage)


def test_stage_in_another_namespace_serves_and_a_cut_link_resumes_every_stream(hosts: Hosts, tmp_path) -> None:
    from tests.support.chat import stream_all
    from tests.support.cluster import api_keys_env

    port = free_port()
    piped = Service(["shard", *INVARIANT_ARGS, "--threads", "1", "--pipeline-parallel-size", "2",
                     "--pipeline-host", hosts.cp_addr, "--pipeline-port", str(port), "--pipeline-remote-stages", "1",
                     "--pipeline-exit-linger-s", "0"], ready_timeout=300)
    plain = Service(["shard", *INVARIANT_ARGS, "--threads", "1"], ready_timeout=300)
    shards = [piped, plain]
    stage: subprocess.Popen[bytes] | None = None
    try:
        for s in shards:
            s.start(wait=False)
        stage_log = tmp_path / "stage1.log"
        stage = _stage(hosts, port, str(stage_log))
        for s in shards:
            try:
                s.wait_healthy()
            except RuntimeError as exc:
                raise AssertionError(f"{exc}\nstage 1 (in {hosts.netns[1]}):\n{stage_log.read_text()[-3000:]}") from None
        assert "waiting for stage 1 to join" in piped.log_tail(20000)
        with Service(["gateway", "--shard-urls", ",".join(s.url for s in shards), "--cache-urls",
                      "http://127.0.0.1:1"], env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()}) as gw:
            prompts = [f"Write a short story about a robot named Unit-{i} who learns to paint." for i in range(8)]
            reference = stream_all(gw.url, "SmolLM2-135M-Instruct", prompts, 24)
            assert all(text for text, _ in reference)
            # The pipelined shard served some of them, every hidden state over the veth link.
            down, back = _hop_ms(piped.url, "0"), _hop_ms(piped.url, "1")
            print(f"\n[netns] hop over veth, mean per pass: stage 0 -> 1 {down:.2f} ms, 1 -> 0 {back:.2f} ms")
            assert metric(piped.url, "switchboard_shard_pipeline_hop_bytes_total", stage="0") > 0

            cut: list[float] = []
            exited: list[float] = []
            proc = piped.proc
            assert proc is not None

            def watch_exit() -> None:
                proc.wait(120)
                exited.append(time.monotonic())

            def cut_once(streams_started: int, chunks: int) -> None:
                if streams_started == len(prompts) and not cut:
                    cut.append(time.monotonic())
                    hosts.cut(1)
                    threading.Thread(target=watch_exit, daemon=True).start()

            got = stream_all(gw.url, "SmolLM2-135M-Instruct", prompts, 24, on_progress=cut_once)
            assert cut
            assert got == reference
            code = proc.wait(30)
            assert code == 1, piped.log_tail()
            log = piped.log_tail(20000)
            assert "stage 1 silent for" in log, log
            silent = float(log.split("stage 1 silent for ", 1)[1].split(" s", 1)[0])
            stranded = stage.wait(30)  # the stage gave up on its group: no heartbeat through for 5 s
            print(f"[netns] link cut: stage 1 declared lost after {silent:.1f} s of silence; the shard exited "
                  f"{exited[0] - cut[0]:.1f} s after the cut, the stranded stage {time.monotonic() - cut[0]:.1f} s")
            assert silent < 3
            assert stranded != 0
    finally:
        if stage is not None and stage.poll() is None:
            stage.kill()
        for s in shards:
            s.stop()
