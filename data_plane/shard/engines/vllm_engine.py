"""`--engine vllm`: vLLM's own OpenAI server as a shard, beside a small sidecar (GPU machines).

    switchboard shard --engine vllm --port 8101 --registry-url http://127.0.0.1:8300 \\
        --model /models/llama-3-8b --dtype bfloat16

vLLM speaks the same protocol as our shards (OpenAI chat completions, `vllm:*` metrics,
`continue_final_message`, `priority`), so the gateway talks to it directly. This module only
runs it: the sidecar starts `python -m vllm.entrypoints.openai.api_server` on an internal
port, serves `/health` (ready only while vLLM is) and `/metrics` (relayed from vLLM) on the
shard port, and registers vLLM's URL in membership while — and only while — vLLM is healthy,
so a sick vLLM leaves routing by itself. vllm is an optional extra (`pip install
'switchboard[vllm]'`, CUDA only); nothing else in Switchboard imports it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from data_plane.common.hop_auth import cluster_token_from_env, guarded_metrics, metrics_token_from_env
from data_plane.common.http_server import free_port, serve
from data_plane.common.lifeline import die_with_parent
from data_plane.common.telemetry import fastapi_options
from data_plane.shard.engines.fingerprint import Numerics, model_digest

log = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0


class ShardSettings(Protocol):
    """What the sidecar reads of the shard's settings: data_plane/shard/settings.py's ``ShardSettings``
    has every one (declared here, not imported: the engines import nothing of the shard above them)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def model(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def registry_url(self) -> str | None: ...
    @property
    def membership(self) -> str | None: ...
    @property
    def node_id(self) -> str | None: ...
    @property
    def zone(self) -> str: ...
    @property
    def registration_ttl_s(self) -> float: ...
    @property
    def advertise_url(self) -> str | None: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...


def vllm_command(settings: ShardSettings, model_path: str, served_name: str, port: int) -> list[str]:
    """The vLLM server command line for these shard settings."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", served_name,
        "--host", "127.0.0.1" if settings.host in ("127.0.0.1", "localhost") else settings.host,
        "--port", str(port),
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len),
        "--max-num-seqs", str(settings.max_num_seqs),
        # vLLM's own parallelism: one server, one shard in membership, its ranks its own business.
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--pipeline-parallel-size", str(settings.pipeline_parallel_size),
        "--scheduling-policy", "priority",  # honours the gateway's per-tier `priority`
        "--disable-uvicorn-access-log",
    ]


def vllm_fingerprint(settings: ShardSettings, model_path: str, served_name: str, version: str) -> str:
    """The `system_fingerprint` of this vLLM server (fingerprint.py): vLLM's chunks carry none of ours, so
    the gateway reads it from the registration. Its kernels are vLLM's `version`'s, and how many GPUs
    split a layer or the model changes the order of their sums."""
    return Numerics(engine="vllm", model=served_name, digest=model_digest(model_path), dtype=settings.dtype,
                    kernel=f"vllm-{version}.tp{settings.tensor_parallel_size}.pp{settings.pipeline_parallel_size}"
                    ).fingerprint()


def vllm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment: this process's, with the cluster token as its API key (``VLLM_API_KEY``: vLLM
    then answers 401 on /v1/* without ``Authorization: Bearer <token>``, which the gateway sends every
    shard), as our own shards require it. Without it, anyone who reached vLLM's port generated on the
    GPU. In the environment, not on the command line (``ps`` shows that)."""
    from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV

    env = dict(os.environ if environ is None else environ)
    token = env.get(CLUSTER_TOKEN_ENV)
    if token:
        env["VLLM_API_KEY"] = token
    return env


def create_sidecar(settings: ShardSettings) -> FastAPI:
    from data_plane.membership.factory import membership_from_url
    from data_plane.membership.view import Member
    from data_plane.model_store import resolve_model, served_name

    try:
        import vllm  # to fail fast with a clear message; its version is in the fingerprint
    except ImportError:
        raise SystemExit("switchboard shard --engine vllm needs vLLM (CUDA only): "
                         "pip install 'switchboard[vllm]' on a GPU machine") from None
    port = free_port()
    name = served_name(settings.model)
    path = str(resolve_model(settings.model))
    cmd = vllm_command(settings, path, name, port)
    fingerprint = vllm_fingerprint(settings, path, name, getattr(vllm, "__version__", "?"))
    vllm_url = f"http://127.0.0.1:{port}"
    state = {"healthy": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the lifespan runs on the event loop's (main) thread; vLLM dies with this sidecar, however it ends
        proc = subprocess.Popen(cmd, env=vllm_env(),  # noqa: ASYNC220 -- once, at start-up
                                preexec_fn=die_with_parent())  # noqa: PLW1509
        http = httpx.AsyncClient(timeout=5.0)
        agent = None
        registry = settings.membership or settings.registry_url
        member = Member(id=settings.node_id or f"shard-{settings.host}-{settings.port}", service="shard",
                        url=settings.advertise_url or vllm_url,
                        meta={"model": name, "engine": "vllm", "max_num_seqs": str(settings.max_num_seqs),
                              "pipeline_parallel_size": str(settings.pipeline_parallel_size),
                              "tensor_parallel_size": str(settings.tensor_parallel_size),
                              "max_model_len": str(settings.max_model_len),
                              "fingerprint": fingerprint,
                              "sidecar": f"http://{settings.host}:{settings.port}", "zone": settings.zone})

        async def watch() -> None:
            nonlocal agent
            while True:
                try:
                    ok = (await http.get(vllm_url + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if proc.poll() is not None:
                    ok = False
                if ok != state["healthy"]:
                    log.info("vLLM is %s", "healthy" if ok else "unhealthy")
                state["healthy"] = ok
                if registry:
                    if ok and agent is None:
                        _, new_agent = membership_from_url(registry, http, ())
                        agent = new_agent(member, settings.registration_ttl_s)
                        await agent.start()
                    elif not ok and agent is not None:
                        await agent.aclose()  # leave routing while vLLM is sick
                        agent = None
                await asyncio.sleep(HEALTH_POLL_S)

        task = asyncio.create_task(watch(), name="vllm-health-watch")
        try:
            yield
        finally:
            task.cancel()
            if agent is not None:
                await agent.aclose()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            await http.aclose()

    app = FastAPI(title="Switchboard vLLM sidecar", lifespan=lifespan, **fastapi_options())

    @app.get("/health")
    async def health() -> JSONResponse:
        if state["healthy"]:
            return JSONResponse({"status": "ok", "engine": "vllm", "upstream": vllm_url})
        return JSONResponse({"status": "loading", "engine": "vllm"}, status_code=503)

    async def metrics(request: Request) -> Response:
        async with httpx.AsyncClient(timeout=5.0) as client:
            try:
                r = await client.get(vllm_url + "/metrics")
            except httpx.HTTPError:
                return Response("# vLLM unreachable\n", status_code=503, media_type="text/plain")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    app.add_route("/metrics", guarded_metrics(metrics, cluster_token_from_env(), metrics_token_from_env()))
    return app


def run_sidecar(settings: ShardSettings) -> None:
    serve(create_sidecar(settings), host=settings.host, port=settings.port)
