"""`switchboard up`: the whole platform on one machine, on embedded defaults.

    switchboard up                                  # control plane, 2 shards, 2 cache nodes, gateway
    switchboard up --shards 1 --dtype float32 --gateway-port 9000
    switchboard up --engine synthetic               # no model: stack testing only
    switchboard up --autoscale --min-replicas 1 --max-replicas 3   # the control plane starts the shards

Starts every process as a child on loopback, waits for each to be healthy, prints the URLs,
one dev API key per tier and the admin token (each in full only on the run that made it, and only to a
terminal: `up > up.log` gets where they are instead, control_plane/up_banner.py). The gateway's
keys file holds only the keys' digests; the keys themselves go to the operator's client credentials file
`.switchboard/credentials.json` (mode 600, control_plane/dev_credentials.py). A child that dies is
reported and restarted (with backoff); Ctrl-C or SIGTERM stops everything cleanly, at any moment of
start-up too, and no child outlives the launcher (kill -9, a crash) by more than moments
(control_plane/supervisor.py, data_plane/common/lifeline.py).
Logs go to `.switchboard/logs/<process>.log`, rotated at --log-max-bytes; one `up` per state dir at a time
(control_plane/state_dir.py). Dispatched by `switchboard up` (control_plane/cli.py); the
children and their supervision are control_plane/supervisor.py; its flags control_plane/up_settings.py.

With ``--autoscale`` the launcher starts no shard itself: the control plane's autoscaler (local
actuator) starts ``--min-replicas`` shards with the same engine flags, scales out to
``--max-replicas`` on a queue (not on a long prompt), drains and stops them when load falls, and
stops them on exit. The decisions are in the console's Autoscaler page and ``/admin/v1/decisions``.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from control_plane.admin.processes import FILE_NAME as PROCESSES
from control_plane.dev_credentials import prepare, record_urls
from control_plane.ports import busy_ports, shared_ports
from control_plane.state_dir import LogRotation, hold_state_dir
from control_plane.supervisor import Child, Stopped, Supervisor, wait_healthy
from control_plane.up_banner import banner, console_host, forget_login_link, new_console_login
from control_plane.up_settings import UpSettings
from data_plane.common.cores import usable_cores
from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV, METRICS_TOKEN_ENV
from data_plane.common.http_server import free_port
from data_plane.common.settings_cli import parse_settings
from data_plane.common.tls import TlsConfig, make_dev_pki
from data_plane.membership.placement import DEFAULT_ZONE

RESUME_WAIT_S = 60
"""The gateways' --resume-wait-s under `up`: a stream whose lone shard (or pipeline group) died mid-way waits
this long for the supervisor to bring it back (1 s backoff, then a model load: 16 s from the kill on a busy
2-core host, 18-30 s when both shards of `up --shards 2` were stopped 3 s apart under load, which 30 s missed
by ~1 s) and finishes there, instead of ending with an error (a standalone gateway waits 0 s)."""


def plan(s: UpSettings, state: Path, admin_token: str, cluster_token: str,
         metrics_token: str | None = None) -> tuple[Child, list[Child], list[Child], list[Child]]:
    """The children to start: control plane, cache nodes, shards, gateways (one per zone)."""
    zones = s.zones or [DEFAULT_ZONE]
    member_env = {CLUSTER_TOKEN_ENV: cluster_token}  # registering in the control plane needs it
    if metrics_token:  # every /metrics also opens to it: the token `--prometheus` scrapes with
        member_env[METRICS_TOKEN_ENV] = metrics_token
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    host = s.host
    registry = f"http://{host}:{s.control_plane_port}"
    usage_db = s.usage_db or f"sqlite:///{state / 'usage.db'}"  # gateways write it, the control plane reads it
    cp = Child("control-plane", ["control-plane", "--host", host, "--port", str(s.control_plane_port),
                                 "--state-dir", str(state / "control-plane"), "--usage-db", usage_db,
                                 "--processes-file", str(state / PROCESSES)],
               registry, logs / "control-plane.log", env={"SWITCHBOARD_ADMIN_TOKEN": admin_token, **member_env})
    if s.abuse_rules:
        cp.args += ["--abuse-rules", str(Path(s.abuse_rules).resolve())]
    if s.autoscale:
        if s.min_replicas > s.max_replicas:
            raise SystemExit(f"switchboard up: --min-replicas {s.min_replicas} > --max-replicas {s.max_replicas}")
        # Every stage process of a group takes its threads: the host cap counts stage processes.
        scaled_threads = max(1, usable_cores() // (s.max_replicas * s.pipeline_parallel_size))
        cp.args += ["--autoscale", "--min-replicas", str(s.min_replicas), "--max-replicas", str(s.max_replicas),
                    "--shard-log-dir", str(logs), "--shard-args", shlex.join(_shard_flags(s, scaled_threads, state))]
        if s.zones:  # its first shards start before any zone's member is seen: they go into these, not `local`
            cp.args += ["--shard-zones", ",".join(zones)]
        if s.engine == "torch":  # a torch shard past the cores slows the others (the synthetic one uses none)
            cp.args += ["--local-max-shards", str(local_max_shards(s, scaled_threads))]
    elif {"min_replicas", "max_replicas"} & s.model_fields_set:  # they size the autoscaler alone: said, not ignored
        raise SystemExit("switchboard up: --min-replicas/--max-replicas size the autoscaler: add --autoscale, "
                         "or give a fixed number of shards with --shards")
    caches = []
    for i in range(max(s.cache_nodes, len(zones))):
        port = s.cache_base_port + i if s.cache_base_port else free_port(host)
        zone = zones[i % len(zones)]
        args = ["cache-node", "--host", host, "--port", str(port), "--registry-url", registry,
                "--node-id", f"cache-{i}", "--zone", zone]
        if s.redis:
            args += ["--redis", s.redis]
        else:  # stored responses and conversations outlive a restart, as the keys and the ledger do
            args += ["--snapshot-file", str(state / "cache" / f"cache-{i}.jsonl")]
        caches.append(Child(f"cache-{i}", args, f"http://{host}:{port}", logs / f"cache-{i}.log", env=member_env))
    shards = []
    n_shards = 0 if s.autoscale else (max(s.shards, len(zones)) if s.shards else 0)
    threads = max(1, usable_cores() // max(1, n_shards * s.pipeline_parallel_size))
    for i in range(n_shards):
        port = s.shard_base_port + i if s.shard_base_port else free_port(host)
        args = ["shard", "--host", host, "--port", str(port), "--registry-url", registry, "--node-id", f"shard-{i}",
                "--zone", zones[i % len(zones)], *_shard_flags(s, threads, state)]
        shards.append(Child(f"shard-{i}", args, f"http://{host}:{port}", logs / f"shard-{i}.log", env=member_env))
    gateways = []
    for i, zone in enumerate(zones):
        port = s.gateway_port + i
        name = "gateway" if i == 0 else f"gateway-{zone}"
        gw_args = ["gateway", "--host", host, "--port", str(port), "--registry-url", registry,
                   "--keys-file", str(state / "keys.yaml"), "--max-model-len", str(s.max_model_len),
                   "--state-dir", str(state / name), "--usage-db", usage_db,
                   "--session-keys-file", str(state / "session_keys"), "--node-id", f"{name}-{port}",
                   "--zone", zone, "--resume-wait-s", str(RESUME_WAIT_S)]
        if s.response_cache:
            gw_args.append("--response-cache")
        if s.trusted_proxies:
            gw_args += ["--trusted-proxies", s.trusted_proxies]
        if s.engine == "synthetic":
            gw_args += ["--tokenizer", "whitespace", "--model-name", "synthetic"]
        elif s.model:
            gw_args += ["--tokenizer", s.model]
        gateways.append(Child(name, gw_args, f"http://{host}:{port}", logs / f"{name}.log", env=member_env))
    return cp, caches, shards, gateways


def local_max_shards(s: UpSettings, threads: int, cores: int | None = None) -> int:
    """Shards (pipeline groups) the local actuator may run: as many stage processes of `threads`
    threads as the cores hold, divided into groups of `pipeline_parallel_size` (at least min_replicas)."""
    stages = (cores or usable_cores()) // threads
    return max(s.min_replicas, stages // s.pipeline_parallel_size)


def _shard_flags(s: UpSettings, threads: int, state: Path) -> list[str]:
    """Engine flags of every shard, started here or by the autoscaler; KV blocks are sealed with
    keys derived from the gateway's session keys file (data_plane/shard/kv_seal.py)."""
    args = ["--engine", s.engine, "--dtype", s.dtype, "--quantization", s.quantization,
            "--quantization-kernel", s.quantization_kernel,
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-model-len", str(s.max_model_len), "--threads", str(threads),
            "--kv-keys-file", str(state / "session_keys")]
    if s.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(s.pipeline_parallel_size)]
        if s.prometheus:  # a group that lost a stage answers /metrics until a scrape has seen its stage_up 0
            args += ["--pipeline-exit-linger-s", str(SCRAPE_INTERVAL_S + 1)]
    return args + (["--model", s.model] if s.model else [])


def console_child(s: UpSettings, state: Path, cp: Child, gateway: Child, admin_token: str,
                  login_code: str = "", host: str | None = None) -> Child:
    """The console, with the admin token and this run's one-time login code in its environment
    (admin_ui/login.py: the banner prints the link ``/?token=CODE``; neither is ever in argv)."""
    host = host or s.host
    return Child("console", ["console", "--host", host, "--port", str(s.console_port), "--control-plane-url",
                             cp.url, "--gateway-url", gateway.url, "--credentials-file",
                             str(state / "credentials.json"), "--keys-file", str(state / "keys.yaml")],
                 f"http://{host}:{s.console_port}", state / "logs" / "console.log",
                 env={"SWITCHBOARD_ADMIN_TOKEN": admin_token, LOGIN_CODE_ENV: login_code or secrets.token_urlsafe(32)},
                 health="/_stcore/health")


LOGIN_CODE_ENV = "SWITCHBOARD_CONSOLE_LOGIN_CODE"  # admin_ui.settings.ENV_LOGIN_CODE (`up` imports no console)


def relink_console(state: Path, tty: bool) -> Callable[[Child], None]:
    """The supervisor's hook before a restart: a restarted console forgets which codes were spent, so it gets a
    fresh one (the banner's link would log anyone in again), and its link goes where the banner's went (the
    terminal, or STATE/console_login): the restart left the operator with no working link otherwise."""
    def before_restart(child: Child) -> None:
        if child.name == "console":
            child.env[LOGIN_CODE_ENV] = secrets.token_urlsafe(32)
            new_console_login(state, f"{child.url}/?token={child.env[LOGIN_CODE_ENV]}", tty)
    return before_restart

ALERTS_DIR = Path(__file__).resolve().parent.parent / "alerts"
SCRAPE_JOBS = {"gateway": "switchboard-gateway", "shard": "switchboard-shard", "cache": "switchboard-cache"}
"""Job names the alert rules and dashboards assume (dashboards/catalogue.py JOBS)."""
SCRAPE_INTERVAL_S = 5
"""`--prometheus`'s scrape and evaluation interval; pipelined shards linger a second longer than it."""


def prometheus_child(s: UpSettings, state: Path, cp: Child, shards: Sequence[Child] = (),
                     caches: Sequence[Child] = (), gateways: Sequence[Child] = ()) -> Child | None:
    """A Prometheus that discovers members through the control plane (HTTP SD), with our rules.

    The shards, cache nodes and gateways started here are static targets too: HTTP SD lists live members
    only, so one that died or hung left the targets at the next refresh (5 s) and its `up` series with it:
    SwitchboardCacheNodeDown and SwitchboardGatewayDown (`up == 0` for minutes) could never fire, and a
    shard that lost a pipeline stage left before any scrape saw its `switchboard_shard_pipeline_stage_up`
    0 (SwitchboardPipelineStageDown never fired in two of two kill -9 trials). Other members (autoscaled,
    added by hand) come from SD; one in both is one target.

    Every job presents the metrics token (every /metrics is guarded): read from `state/metrics_token`
    (mode 600, made by dev_credentials.prepare) as its `credentials_file`, so prometheus.yml holds a
    path, not the token."""
    import shutil

    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        print("[switchboard] --prometheus: no prometheus binary on PATH (apt-get install prometheus); skipping",
              flush=True)
        return None
    folder = state / "prometheus"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    started = {"shard": shards, "cache": caches, "gateway": gateways}
    config: dict[str, Any] = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(p) for p in sorted(ALERTS_DIR.glob("*.rules.yaml"))],
        "scrape_configs": [{"job_name": "switchboard-control-plane", "static_configs": [
            {"targets": [cp.url.split("://", 1)[1]]}]}] + [
            {"job_name": job, "static_configs": [{"targets": [c.url.split("://", 1)[1] for c in started[service]],
                                                  "labels": {"switchboard_service": service}}]
             if started[service] else [],
             "http_sd_configs": [{"url": f"{cp.url}/v1/sd/prometheus?service={service}",
                                  "refresh_interval": f"{SCRAPE_INTERVAL_S}s"}]}
            for service, job in SCRAPE_JOBS.items()],
    }
    for job in config["scrape_configs"]:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(state / "metrics_token")}
    ca = os.environ.get("SSL_CERT_FILE")
    if cp.url.startswith("https://") and ca:  # --tls: scrape and discover over https, verified with our CA
        for job in config["scrape_configs"]:
            job.update(scheme="https", tls_config={"ca_file": ca})
            for sd in job.get("http_sd_configs", []):
                sd["tls_config"] = {"ca_file": ca}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    url = f"http://{console_host(s, False)}:{s.prometheus_port}"  # never on the network: it has no auth, no TLS
    return Child("prometheus", [], url, state / "logs" / "prometheus.log", health="/-/ready", command=[
        binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={url.split('://', 1)[1]}", "--storage.tsdb.retention.time=2d"])


def main(argv: list[str] | None = None) -> None:
    s = parse_settings(UpSettings, argv, prog="switchboard up")
    state = Path(s.state_dir).resolve()
    try:
        state.mkdir(parents=True, exist_ok=True)
        os.chmod(state, 0o700)
        lock = hold_state_dir(state)  # noqa: F841 (held while this process lives; one `up` per folder)
        forget_login_link(state)  # an earlier run's: dead (its console is gone)
    except OSError as exc:  # a file in the way, a read-only disk, another user's folder: one line
        why = "a file, not a folder" if isinstance(exc, FileExistsError) and state.is_file() else exc.strerror or exc
        raise SystemExit(f"switchboard up: cannot use --state-dir {state}: {why}"
                         f"{f' ({exc.filename})' if exc.filename and str(exc.filename) != str(state) else ''}; "
                         "give a folder this user can write") from None
    if s.engine == "torch":
        from data_plane.model_store import ModelNotAvailable, resolve_model

        try:
            resolve_model(s.model)  # converts the GGUF once, before shards race to do it
        except ModelNotAvailable as exc:
            raise SystemExit(f"switchboard up: {exc}") from None
    try:
        creds = prepare(state)
    except ValueError as exc:  # the keys file (the truth of who may call) does not parse: refuse, in words
        raise SystemExit(f"switchboard up: {exc}") from None
    except OSError as exc:  # a credentials or keys file this user cannot write
        raise SystemExit(f"switchboard up: cannot write in --state-dir {state}: {exc.strerror or exc}"
                         f"{f' ({exc.filename})' if exc.filename else ''}") from None
    tls = s.tls or TlsConfig.from_env().enabled  # --tls, or certificates given (--tls-cert/--tls-key)
    if s.tls and not TlsConfig.from_env().enabled:  # every child inherits it: listen, and verify peers with the CA
        os.environ.update(make_dev_pki(state / "tls", tuple(dict.fromkeys((s.host, "127.0.0.1", "localhost")))).env())
    cp, caches, shards, gateways = plan(s, state, str(creds["admin_token"]), str(creds["cluster_token"]),
                                        str(creds["metrics_token"]))
    gateway = gateways[0]
    if tls:
        for child in (cp, *caches, *shards, *gateways):
            _https(child)
    record_urls(state, control_plane_url=cp.url, gateway_url=gateway.url)
    prometheus = prometheus_child(s, state, cp, shards, caches, gateways) if s.prometheus else None
    console = (console_child(s, state, cp, gateway, str(creds["admin_token"]), host=console_host(s, tls))
               if s.console else None)
    if tls and console is not None:
        _https(console)
    console_login = f"{console.url}/?token={console.env[LOGIN_CODE_ENV]}" if console is not None else None
    if prometheus is not None:
        cp.args += ["--prometheus", prometheus.url]
    order = [cp, *caches, *shards, *gateways] + [c for c in (prometheus, console) if c is not None]
    if clash := shared_ports(order):
        raise SystemExit(f"switchboard up: {'; '.join(clash)}: give each its own port")
    busy = busy_ports(order, s.host)
    if busy:
        raise SystemExit(f"switchboard up: already in use on {s.host}: {', '.join(busy)}. Another `switchboard up` "
                         f"may be running; stop it, or move this one with the flag(s) named.")
    supervisor = Supervisor(order, LogRotation(s.log_max_bytes, s.log_backups), state / "logs", state / PROCESSES,
                            before_restart=relink_console(state, sys.stdout.isatty()))
    supervisor.guard()  # a stop signal from here on stops the children started so far
    try:
        print(f"[switchboard] starting control plane, {len(caches)} cache nodes, {len(shards)} shards, gateway...",
              flush=True)
        supervisor.start(cp)  # each start is in the process table at once (pid, running) as in `run()`
        wait_healthy([cp], 30, "control plane")
        for c in caches + shards:
            supervisor.start(c)
        wait_healthy(caches, 30, "cache nodes")
        wait_healthy(shards, 300, "loading the model")
        for g in gateways:
            supervisor.start(g)
        wait_healthy(gateways, 120, "gateway")
        if s.autoscale:
            print(f"[switchboard] the autoscaler starts {s.min_replicas} shard(s) (up to {s.max_replicas})...",
                  flush=True)
            if not _wait_routable(gateway.url, s.min_replicas, 300):
                raise SystemExit(f"switchboard up: the autoscaler's shards did not serve within 300 s; see "
                                 f"{cp.log_path} and {state / 'logs'}/shard-local-*.log")
        else:
            _wait_routable(gateway.url, len(shards), 15)
        extras = [c for c in (prometheus, console) if c is not None]
        for child in extras:
            supervisor.start(child)
        wait_healthy(extras, 90, "prometheus / console")
    except Stopped as stop:
        supervisor.shutdown()
        raise SystemExit(f"switchboard up: stopped by {stop} during start-up") from None
    except BaseException:
        supervisor.shutdown()
        raise
    try:
        stages = _pipeline_stages(cp, creds["admin_token"], shards) if s.pipeline_parallel_size > 1 else {}
        # secrets (keys, admin token, login link) only to a terminal: control_plane/up_banner.py
        banner(s, creds, cp, caches, shards, gateways, state, stages, console_login, tty=sys.stdout.isatty())
        supervisor.run()  # until a stop signal
    except Stopped:  # between the start-up and run()
        pass
    finally:
        supervisor.shutdown()  # however it ended (a crash too); the children die with us regardless
        forget_login_link(state)


def _https(child: Child) -> None:
    """The child's own URL and the URLs in its flags (the registry's) on https."""
    child.url = child.url.replace("http://", "https://", 1)
    child.args = [a.replace("http://", "https://") for a in child.args]


def _wait_routable(url: str, shards: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).json().get("shards", 0) >= min(shards, 1):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _pipeline_stages(cp: Child, admin_token: str, shards: list[Child], timeout: float = 10.0) -> dict[str, str]:
    """Each pipelined shard's stages as it registered them ("0@host:0-11,1@host:11-30": stage@host:layers,
    data_plane/shard/stage_view.py), read from the admin API, for the banner. A shard registers just after
    its /health answers, so this waits a little; a shard still missing is printed without its stages."""
    names = {c.name for c in shards}
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while names - set(found) and time.monotonic() < deadline:
        try:
            members = httpx.get(cp.url + "/admin/v1/members", timeout=2,
                                headers={"Authorization": f"Bearer {admin_token}"}).json()["members"]
        except (httpx.HTTPError, ValueError, KeyError):
            members = []
        found = {str(m.get("id")): str(m["meta"]["pipeline_stages"]) for m in members
                 if m.get("id") in names and "pipeline_stages" in (m.get("meta") or {})}
        time.sleep(0.2)
    return found
