"""Actuators: the local one on real shard processes; Nomad and Kubernetes against HTTP stubs of
their documented APIs (and live, when NOMAD_ADDR / a kubeconfig and a target are given)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from control_plane.scaling.actuators import ActuatorError
from control_plane.scaling.actuators.kubernetes import KubeClient, KubernetesActuator, default_kubeconfig
from control_plane.scaling.actuators.local import LocalActuator
from control_plane.scaling.actuators.nomad import NomadActuator
from tests.support.http_stub import serve_app
from tests.support.procs import CLUSTER_TOKEN, Service, free_port
from tests.support.waits import eventually_async

ENV_NOMAD_ADDR = "NOMAD_ADDR"
"""Set to run the Nomad adapter against that live cluster too (read and no-op scale only)."""
ENV_NOMAD_JOB = "SWITCHBOARD_TEST_NOMAD_JOB"
"""Live Nomad: the job (group ``shard``) to read; default ``switchboard``."""
ENV_K8S_DEPLOYMENT = "SWITCHBOARD_TEST_K8S_DEPLOYMENT"
"""Live Kubernetes: ``namespace/deployment`` to read (and no-op scale) through the kubeconfig."""


# -- the local actuator, on real processes -----------------------------------------------------------


def _members(cp: Service) -> dict[str, dict[str, Any]]:
    body = httpx.get(cp.url + "/v1/registry/members", params={"service": "shard"}).json()
    return {m["id"]: m for m in body["members"]}


async def test_local_actuator_starts_drains_and_stops_real_shards(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The shards it starts inherit the control plane's environment, cluster token included.
    monkeypatch.setenv("SWITCHBOARD_CLUSTER_TOKEN", CLUSTER_TOKEN)
    with Service(["control-plane", "--admin-token", "actuator-test-token"]) as cp:
        async with httpx.AsyncClient() as http:
            actuator = LocalActuator(
                cp.url,
                http,
                admin_token="actuator-test-token",
                log_dir=tmp_path,
                settle_s=0.3,
                shard_args=["--engine", "synthetic", "--synthetic-token-delay-ms", "40"],
            )
            try:
                await actuator.scale_to(2, "test: two shards")
                assert await actuator.current() == 2  # starting ones count: no double start
                await eventually_async(lambda: len(_members(cp)) == 2, 30, 0.1, what="two shards registered")
                first, second = actuator.shards()
                assert first["id"].startswith("shard-local-") and Path(first["log"]).parent == tmp_path

                os.kill(first["pid"], signal.SIGKILL)  # a shard that dies is forgotten
                await eventually_async(lambda: len(actuator.shards()) == 1, 5, 0.1,
                                       what="dead shard forgotten")
                assert await actuator.current() == 1

                # a request in flight on the shard being removed finishes before it stops
                # ~8 s: it outlasts the checks below on a loaded CI (at 40 tokens, ~1.6 s, it had ended before them)
                stream = asyncio.create_task(_stream(http, second["url"], max_tokens=200))
                await eventually_async(lambda: _health(second["url"]).get("running") == 1, 5, 0.1,
                                       what="request running")
                await actuator.scale_to(0, "test: low load")
                assert await actuator.current() == 0
                await eventually_async(lambda: _members(cp).get(second["id"], {}).get("status") == "draining", 3, 0.1,
                                       what="marked draining in the registry")
                assert not stream.done()
                assert (await stream).endswith("data: [DONE]")
                await actuator.wait_drained()
                assert actuator.shards() == []
                # it deregistered itself on SIGTERM (not left to expire)
                assert second["id"] not in _members(cp)
                with pytest.raises(httpx.HTTPError):
                    httpx.get(second["url"] + "/health", timeout=1)  # noqa: ASYNC210 -- a 1 s probe of a dead port

                # closing the actuator (control-plane shutdown) stops what it started
                await actuator.scale_to(1, "test: one more")
                pid = actuator.shards()[0]["pid"]
                with pytest.raises(ActuatorError):
                    await actuator.scale_to(-1, "nonsense")
            finally:
                await actuator.aclose()
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def _health(url: str) -> dict[str, Any]:
    try:
        return httpx.get(url + "/health", timeout=1).json()
    except (httpx.HTTPError, ValueError):
        return {}


async def _stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": "drain me"}], "max_tokens": max_tokens, "stream": True}
    async with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"}) as r:
        assert r.status_code == 200
        return (await r.aread()).decode().strip()


# -- HTTP stubs ------------------------------------------------------------------------------------------


class NomadStub:
    """A STUB of Nomad's job scale API (``GET``/``POST /v1/job/:job_id/scale``), shapes as in
    Nomad's HTTP API docs; one job with task groups, ACL token optional, namespaces honoured."""

    def __init__(
        self,
        job: str = "switchboard",
        groups: dict[str, int] | None = None,
        namespace: str = "default",
        token: str | None = None,
    ) -> None:
        self.job, self.namespace, self.token = job, namespace, token
        self.groups = dict(groups or {"shard": 1, "cache": 2})
        self.index = 10
        self.events: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.get("/v1/job/{job_id}/scale")(self._status)
        self.app.post("/v1/job/{job_id}/scale")(self._scale)

    def _check(self, request: Request, job_id: str) -> PlainTextResponse | None:
        if self.token is not None and request.headers.get("X-Nomad-Token") != self.token:
            return PlainTextResponse("Permission denied", status_code=403)
        if job_id != self.job or request.query_params.get("namespace", "default") != self.namespace:
            return PlainTextResponse("job not found", status_code=404)
        return None

    async def _status(self, request: Request, job_id: str) -> Any:
        if (error := self._check(request, job_id)) is not None:
            return error
        return {
            "JobID": self.job,
            "Namespace": self.namespace,
            "JobCreateIndex": 10,
            "JobModifyIndex": self.index,
            "JobStopped": False,
            "TaskGroups": {
                g: {
                    "Desired": n,
                    "Placed": n,
                    "Running": n,
                    "Healthy": n,
                    "Unhealthy": 0,
                    "Events": [e for e in self.events if e["group"] == g],
                }
                for g, n in self.groups.items()
            },
        }

    async def _scale(self, request: Request, job_id: str) -> Any:
        if (error := self._check(request, job_id)) is not None:
            return error
        body = await request.json()
        group = (body.get("Target") or {}).get("Group")
        if not group:
            return PlainTextResponse("missing task group name", status_code=400)
        if group not in self.groups:
            return PlainTextResponse(
                f'task group "{group}" specified for scaling does not exist in job', status_code=400
            )
        count = body.get("Count")
        if count is not None and count < 0:
            return PlainTextResponse("scaling action count can't be negative", status_code=400)
        self.events.append(
            {
                "group": group,
                "count": count,
                "previous": self.groups[group],
                "message": body.get("Message"),
                "meta": body.get("Meta"),
            }
        )
        if count is not None:
            self.groups[group] = count
        self.index += 1
        return {
            "EvalID": str(uuid.uuid4()),
            "EvalCreateIndex": self.index,
            "JobModifyIndex": self.index,
            "Warnings": "",
            "Index": self.index,
            "LastContact": 0,
            "KnownLeader": False,
        }


class KubernetesStub:
    """A STUB of the Kubernetes API server's Deployment ``scale`` subresource (apps/v1), with its
    ``Status`` error bodies: bearer auth, GET and merge-patch PATCH."""

    def __init__(
        self,
        namespace: str = "switchboard",
        deployment: str = "switchboard-shard",
        replicas: int = 1,
        token: str = "stub-token",
    ) -> None:
        self.namespace, self.deployment, self.replicas, self.token = namespace, deployment, replicas, token
        self.resource_version = 100
        self.patches: list[dict[str, Any]] = []
        self.app = FastAPI()
        path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        self.app.get(path)(self._get)
        self.app.patch(path)(self._patch)

    @staticmethod
    def _status(code: int, reason: str, message: str) -> JSONResponse:
        return JSONResponse(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            },
            status_code=code,
        )

    def _check(self, request: Request, ns: str, name: str) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return self._status(401, "Unauthorized", "Unauthorized")
        if (ns, name) != (self.namespace, self.deployment):
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        return None

    def _scale(self) -> dict[str, Any]:
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": self.deployment,
                "namespace": self.namespace,
                "uid": "6c1d-stub",
                "resourceVersion": str(self.resource_version),
                "creationTimestamp": "2026-11-29T00:00:00Z",
            },
            "spec": {"replicas": self.replicas},
            "status": {"replicas": self.replicas, "selector": "app.kubernetes.io/name=switchboard-shard"},
        }

    async def _get(self, request: Request, ns: str, name: str) -> Any:
        return self._check(request, ns, name) or self._scale()

    async def _patch(self, request: Request, ns: str, name: str) -> Any:
        if (error := self._check(request, ns, name)) is not None:
            return error
        if request.headers.get("content-type", "").split(";")[0] != "application/merge-patch+json":
            return self._status(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - "
                "accepted media types include: application/json-patch+json, "
                "application/merge-patch+json, application/apply-patch+yaml",
            )
        patch = json.loads(await request.body())
        self.patches.append(patch)
        replicas = (patch.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            return self._status(
                422,
                "Invalid",
                f'Scale.autoscaling "{name}" is invalid: spec.replicas: '
                "Invalid value: must be greater than or equal to 0",
            )
        self.replicas = replicas
        self.resource_version += 1
        return self._scale()


@pytest.fixture
def nomad_stub() -> Iterator[tuple[NomadStub, str]]:
    stub = NomadStub(namespace="serving", token="s3cret")
    with serve_app(stub.app) as url:
        yield stub, url


@pytest.fixture
def kubernetes_stub() -> Iterator[tuple[KubernetesStub, str]]:
    stub = KubernetesStub(replicas=2)
    with serve_app(stub.app) as url:
        yield stub, url


async def test_nomad_adapter_reads_and_scales_the_task_group(nomad_stub: tuple[NomadStub, str]) -> None:
    stub, url = nomad_stub
    async with httpx.AsyncClient() as http:
        nomad = NomadActuator(
            http, addr=url, job="switchboard", group="shard", namespace="serving", token="s3cret"
        )
        assert await nomad.current() == 1
        await nomad.scale_to(3, "waiting above target")
        assert await nomad.current() == 3 and stub.groups == {"shard": 3, "cache": 2}
        assert stub.events[-1] == {
            "group": "shard",
            "count": 3,
            "previous": 1,
            "message": "waiting above target",
            "meta": {"source": "switchboard-autoscaler"},
        }

        for bad, match in [
            (NomadActuator(http, addr=url, namespace="serving", token="wrong"), "403: Permission denied"),
            (
                NomadActuator(http, addr=url, namespace="serving", token="s3cret", job="nope"),
                "404: job not found",
            ),
            (
                NomadActuator(http, addr=url, namespace="serving", token="s3cret", group="gpu"),
                "no task group",
            ),
            (NomadActuator(http, addr=f"http://127.0.0.1:{free_port()}"), "ConnectError"),
        ]:
            with pytest.raises(ActuatorError, match=match):
                await bad.current()
        with pytest.raises(ActuatorError, match="can't be negative"):
            await nomad.scale_to(-1, "nonsense")


async def test_kubernetes_adapter_patches_the_scale_subresource(
    kubernetes_stub: tuple[KubernetesStub, str], tmp_path: Path
) -> None:
    stub, url = kubernetes_stub
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {  # JSON is YAML; shaped as `kubectl config view` writes it
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stub",
                "clusters": [
                    {
                        "name": "stub",
                        "cluster": {
                            "server": url,
                            "certificate-authority-data": base64.b64encode(
                                b"unused over plain http"
                            ).decode(),
                        },
                    }
                ],
                "contexts": [
                    {
                        "name": "stub",
                        "context": {"cluster": "stub", "user": "autoscaler", "namespace": "switchboard"},
                    }
                ],
                "users": [{"name": "autoscaler", "user": {"token": "stub-token"}}],
            }
        )
    )
    with pytest.raises(ActuatorError, match="TLS settings"):  # garbage CA data is refused up front
        KubernetesActuator.from_kubeconfig(kubeconfig, deployment="switchboard-shard")
    config = json.loads(kubeconfig.read_text())
    del config["clusters"][0]["cluster"]["certificate-authority-data"]
    kubeconfig.write_text(json.dumps(config))

    kube = KubernetesActuator.from_kubeconfig(kubeconfig, deployment="switchboard-shard")
    try:
        assert await kube.current() == 2
        await kube.scale_to(4, "TTFT p95 above SLO")
        assert await kube.current() == 4 and stub.patches == [{"spec": {"replicas": 4}}]
        with pytest.raises(ActuatorError, match="422: .*must be greater than or equal to 0"):
            await kube.scale_to(-1, "nonsense")
    finally:
        await kube.aclose()

    async with httpx.AsyncClient() as http:
        anonymous = KubernetesActuator(
            KubeClient(url, namespace="switchboard", http=http), deployment="switchboard-shard"
        )
        with pytest.raises(ActuatorError, match="401: Unauthorized"):
            await anonymous.current()
        missing = KubernetesActuator(
            KubeClient(url, namespace="switchboard", token="stub-token", http=http), deployment="nope"
        )
        with pytest.raises(ActuatorError, match='404: deployments.apps "nope" not found'):
            await missing.current()

    config["users"][0]["user"] = {"exec": {"command": "aws", "args": ["eks", "get-token"]}}
    kubeconfig.write_text(json.dumps(config))
    with pytest.raises(ActuatorError, match="exec/auth-provider plugin"):
        KubernetesActuator.from_kubeconfig(kubeconfig, deployment="switchboard-shard")


# -- live (skipped unless pointed at a real scheduler) -------------------------------------------------


@pytest.mark.skipif(not os.environ.get(ENV_NOMAD_ADDR), reason=f"{ENV_NOMAD_ADDR} not set (no live Nomad)")
async def test_nomad_live_read_and_noop_scale() -> None:
    async with httpx.AsyncClient() as http:
        nomad = NomadActuator(
            http,
            addr=os.environ[ENV_NOMAD_ADDR],
            job=os.environ.get(ENV_NOMAD_JOB, "switchboard"),
            token=os.environ.get("NOMAD_TOKEN"),
            namespace=os.environ.get("NOMAD_NAMESPACE"),
        )
        n = await nomad.current()
        await nomad.scale_to(n, "switchboard live test: no change")
        assert await nomad.current() == n


@pytest.mark.skipif(
    default_kubeconfig() is None or not os.environ.get(ENV_K8S_DEPLOYMENT),
    reason=f"no kubeconfig or {ENV_K8S_DEPLOYMENT} (namespace/deployment) not set",
)
async def test_kubernetes_live_read_and_noop_scale() -> None:
    namespace, _, deployment = os.environ[ENV_K8S_DEPLOYMENT].rpartition("/")
    kube = KubernetesActuator.from_kubeconfig(deployment=deployment, namespace=namespace or None)
    try:
        n = await kube.current()
        await kube.scale_to(n, "switchboard live test: no change")
        assert await kube.current() == n
    finally:
        await kube.aclose()


# -- the deploy files drive real flags -------------------------------------------------------------------

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_DUMMY = {
    "POD_IP": "10.0.0.7",
    "HOST_IP": "10.0.0.1",
    "POD_NAME": "pod-0",
    "NOMAD_IP_http": "10.0.0.1",
    "NOMAD_PORT_http": "24000",
    "NOMAD_ADDR_http": "10.0.0.1:24000",
    "NOMAD_JOB_ID": "switchboard",
    "NOMAD_ALLOC_ID": "a1",
    "NOMAD_ALLOC_INDEX": "0",
    "attr.unique.network.ip-address": "10.0.0.1",
    "node.datacenter": "dc1",
    "var.shard_engine": "torch",
    "var.shard_max_num_seqs": "16",
    "var.shard_pipeline_parallel_size": "2",
    "var.shard_threads_per_stage": "1",
}


def _parse_command(args: list[str]) -> Any:
    """Parse a `switchboard ...` command line with the subcommand's own parser (exits on a bad flag)."""
    from control_plane.app import parse_settings as control_plane
    from data_plane.cache.node import parse_settings as cache_node
    from data_plane.common.settings_cli import parse_settings
    from data_plane.gateway.app import GatewaySettings
    from data_plane.shard.settings import ShardSettings

    parsers = {
        "control-plane": control_plane,
        "cache-node": cache_node,
        "shard": lambda a: parse_settings(ShardSettings, a, prog="switchboard shard"),
        "gateway": lambda a: parse_settings(GatewaySettings, a, prog="switchboard gateway"),
    }
    return parsers[args[0]](args[1:])


def _fill(text: str) -> str:
    import re

    text = re.sub(r"\$\((\w+)\)", lambda m: _DUMMY[m.group(1)], text)  # Kubernetes $(VAR)
    return re.sub(r"\$\{([^}]+)\}", lambda m: _DUMMY[m.group(1)], text)  # Nomad ${...}


def test_kubernetes_manifests_use_real_flags_and_let_the_autoscaler_scale_the_shards(monkeypatch) -> None:
    import yaml

    base = DEPLOY / "kubernetes" / "base"
    assert yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())["resources"] == ["base"]
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = [d for f in kustomization["resources"] for d in yaml.safe_load_all((base / f).read_text())]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = by_kind[("ConfigMap", "switchboard-config")]["data"]
    for key, value in config.items():
        monkeypatch.setenv(key, value)
    parsed = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            (container,) = d["spec"]["template"]["spec"]["containers"]
            assert container["command"] == ["switchboard"]
            parsed[d["metadata"]["name"]] = _parse_command([_fill(a) for a in container["args"]])
    cp = parsed["switchboard-control-plane"]
    assert cp.autoscale and cp.actuator == "kubernetes" and cp.membership == "consul://10.0.0.1:8500"
    assert cp.kube_deployment == "switchboard-shard" and ("Deployment", cp.kube_deployment) in by_kind
    assert parsed["switchboard-shard"].membership == "consul://10.0.0.1:8500"
    rule = by_kind[("Role", "switchboard-autoscaler")]["rules"][0]
    assert rule["resources"] == ["deployments/scale"] and set(rule["verbs"]) == {"get", "patch"}
    assert rule["resourceNames"] == [cp.kube_deployment]


def test_nomad_job_uses_real_flags_and_matches_the_nomad_actuator() -> None:
    import re

    hcl = (DEPLOY / "nomad" / "switchboard.nomad.hcl").read_text()
    commands = [json.loads(_fill(block)) for block in re.findall(r"args = (\[[^\]]*\])", hcl)]
    assert sorted(c[0] for c in commands) == ["cache-node", "control-plane", "gateway", "shard"]
    settings = {c[0]: _parse_command(c) for c in commands}
    cp = settings["control-plane"]
    assert (
        cp.autoscale and cp.actuator == "nomad" and (cp.nomad_job, cp.nomad_group) == ("switchboard", "shard")
    )
    assert 'job "switchboard"' in hcl and 'group "shard"' in hcl
    assert settings["shard"].membership is None  # Nomad registers the shards in Consul itself
    # every member knows its zone (the datacenter), and each group spreads over datacenters
    assert {settings[c].zone for c in ("shard", "gateway", "cache-node")} == {"dc1"}
    assert hcl.count('attribute = "${node.datacenter}"') >= 3 and 'zone         = "${node.datacenter}"' in hcl
