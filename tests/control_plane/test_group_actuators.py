"""Pipeline groups as replicas (--pipeline-group-template): the kubernetes and nomad group actuators
against stubs of the Kubernetes API server and Nomad's jobs API on loopback, driven with the real
templates in deploy/ (deploy/kubernetes/pipeline-nodes/group.yaml, deploy/nomad/switchboard-pipeline.nomad.hcl).
No cluster here: what the schedulers then do with the objects is not exercised."""

from __future__ import annotations

import copy
import json
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError

from control_plane.scaling.actuators import ActuatorError, build_actuator
from control_plane.scaling.actuators.kubernetes import KubeClient
from control_plane.scaling.actuators.kubernetes_groups import GroupTemplate, KubernetesGroups
from control_plane.scaling.actuators.nomad import NomadClient
from control_plane.scaling.actuators.nomad_groups import NomadGroups
from control_plane.settings import ControlPlaneSettings
from data_plane.common.settings_cli import parse_settings
from data_plane.shard.engines.pipeline_stage import join_parser
from data_plane.shard.settings import ShardSettings
from tests.support.http_stub import serve_app
from tests.support.nomad_hcl import parse_job
from tests.support.procs import ROOT, free_port

GROUP_YAML = ROOT / "deploy" / "kubernetes" / "pipeline-nodes" / "group.yaml"
GROUP_HCL = ROOT / "deploy" / "nomad" / "switchboard-pipeline.nomad.hcl"
NS, TOKEN = "switchboard", "stub-token"
PIPELINE, MANAGED = "switchboard.dev/pipeline", "app.kubernetes.io/managed-by"


# -- a stub of the Kubernetes API server ----------------------------------------------------------------


class KubernetesObjectsStub:
    """A STUB of the Kubernetes API server for StatefulSets (apps/v1) and Services (v1) in one
    namespace: create (409 AlreadyExists), list by label selector, delete with DeleteOptions
    (Foreground keeps the object, marked deleted, until :meth:`finish_deletions`, as the garbage
    collector does while the pods terminate), bearer auth, ``Status`` error bodies."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.posted: list[tuple[str, dict[str, Any]]] = []
        self.deleted: list[tuple[str, str, str]] = []  # (resource, name, propagationPolicy)
        self.fail: dict[tuple[str, str], tuple[int, str, str]] = {}  # (method, resource) -> code, reason, message
        self.app = FastAPI()
        for api, resource in (("apis/apps/v1", "statefulsets"), ("api/v1", "services")):
            base = f"/{api}/namespaces/{{ns}}/{resource}"
            self.app.get(base)(self._lister(resource))
            self.app.post(base)(self._creator(resource))
            self.app.delete(base + "/{name}")(self._deleter(resource))

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        """An object applied by someone else (kubectl)."""
        self.objects[(resource, obj["metadata"]["name"])] = copy.deepcopy(obj)

    def finish_deletions(self) -> None:
        self.objects = {k: o for k, o in self.objects.items() if "deletionTimestamp" not in o["metadata"]}

    def names(self, resource: str, *, live: bool = True) -> list[str]:
        return sorted(
            name for (r, name), o in self.objects.items()
            if r == resource and ("deletionTimestamp" not in o["metadata"]) == live
        )

    @staticmethod
    def status(code: int, reason: str, message: str) -> JSONResponse:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}
        return JSONResponse(body, status_code=code)

    def _refuse(self, request: Request, ns: str, resource: str) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return self.status(401, "Unauthorized", "Unauthorized")
        if (failure := self.fail.get((request.method, resource))) is not None:
            return self.status(*failure)
        if ns != NS:
            return self.status(403, "Forbidden", f'{resource} is forbidden: cannot use namespace "{ns}"')
        return None

    def _lister(self, resource: str) -> Any:
        async def handle(request: Request, ns: str) -> Any:
            if (error := self._refuse(request, ns, resource)) is not None:
                return error
            wanted = [t.partition("=") for t in request.query_params.get("labelSelector", "").split(",") if t]
            items = [
                o for (r, _), o in sorted(self.objects.items()) if r == resource and all(
                    k in (labels := o["metadata"].get("labels") or {}) and (not eq or labels[k] == v)
                    for k, eq, v in wanted
                )
            ]
            kind = "StatefulSetList" if resource == "statefulsets" else "ServiceList"
            return {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "7"}, "items": items}

        return handle

    def _creator(self, resource: str) -> Any:
        async def handle(request: Request, ns: str) -> Any:
            if (error := self._refuse(request, ns, resource)) is not None:
                return error
            obj = json.loads(await request.body())
            meta = obj["metadata"]
            if meta.get("namespace", ns) != ns:
                return self.status(400, "BadRequest", "the namespace of the provided object does not match "
                                                      "the namespace sent on the request")
            if (resource, meta["name"]) in self.objects:
                return self.status(409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists')
            if resource == "statefulsets":
                pod_labels = obj["spec"]["template"]["metadata"]["labels"]
                if any(pod_labels.get(k) != v for k, v in obj["spec"]["selector"]["matchLabels"].items()):
                    return self.status(422, "Invalid", "spec.template.metadata.labels: Invalid value: "
                                                       "`selector` does not match template `labels`")
            self.posted.append((resource, copy.deepcopy(obj)))
            meta.update(uid=str(uuid.uuid4()), resourceVersion="8", creationTimestamp="2026-12-02T00:00:00Z")
            self.objects[(resource, meta["name"])] = obj
            return JSONResponse(obj, status_code=201)

        return handle

    def _deleter(self, resource: str) -> Any:
        async def handle(request: Request, ns: str, name: str) -> Any:
            if (error := self._refuse(request, ns, resource)) is not None:
                return error
            options = json.loads(await request.body() or b"{}")
            policy = options.get("propagationPolicy", "Background")
            obj = self.objects.get((resource, name))
            if obj is None:
                return self.status(404, "NotFound", f'{resource} "{name}" not found')
            self.deleted.append((resource, name, policy))
            if policy == "Foreground":  # stays until its dependents (the pods) are gone
                obj["metadata"].update(deletionTimestamp="2026-12-02T00:01:00Z", finalizers=["foregroundDeletion"])
                return obj
            del self.objects[(resource, name)]
            return {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}

        return handle


@pytest.fixture
def kube_stub() -> Iterator[tuple[KubernetesObjectsStub, str]]:
    stub = KubernetesObjectsStub()
    with serve_app(stub.app) as url:
        yield stub, url


def _template_docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(GROUP_YAML.read_text()) if d}


POD_ENV = {"RANK": "1", "POD_IP": "10.0.0.7", "POD_NAME": "switchboard-pp-0-0", "HOST_IP": "10.0.0.1"}


def _exec_line(script: str, command: str) -> list[str]:
    """The flags of `exec switchboard <command> ...` in the pod's shell script, its variables filled."""
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:3] == ["exec", "switchboard", command]:
            return [re.sub(r"\$\{?(\w+)\}?", lambda m: POD_ENV[m.group(1)], w) for w in words[3:]]
    raise AssertionError(f"no `exec switchboard {command}` in {script!r}")


def _check_kube_group(stub: KubernetesObjectsStub, g: int, reason: str) -> None:
    """Group g's posted Service and StatefulSet are the template's, renamed for g, and nothing else."""
    (svc,) = [o for r, o in stub.posted if r == "services" and o["metadata"]["name"] == f"switchboard-pp-{g}"]
    (sts,) = [o for r, o in stub.posted if r == "statefulsets" and o["metadata"]["name"] == f"switchboard-pp-{g}"]
    own = {"app.kubernetes.io/name": "switchboard-pp", PIPELINE: str(g)}
    assert sts["metadata"]["labels"] == svc["metadata"]["labels"] == {**own, MANAGED: "switchboard-control-plane"}
    assert sts["metadata"]["namespace"] == svc["metadata"]["namespace"] == NS
    spec, pod = sts["spec"], sts["spec"]["template"]
    assert spec["serviceName"] == f"switchboard-pp-{g}" and spec["replicas"] == 2  # still 2 stages a group
    assert spec["selector"]["matchLabels"] == pod["metadata"]["labels"] == svc["spec"]["selector"] == own
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == own  # the anti-affinity is among this group's stages
    script = pod["spec"]["containers"][0]["args"][0]
    stage = join_parser().parse_args(_exec_line(script, "stage"))
    assert stage.join == f"switchboard-pp-{g}-0.switchboard-pp-{g}:29500"  # stage 0 of this group
    shard = parse_settings(ShardSettings, _exec_line(script, "shard"), "switchboard shard")
    assert shard.pipeline_parallel_size == 2 and shard.pipeline_remote_stages == "1"
    assert sts["metadata"]["annotations"] == {"switchboard.dev/scaled-for": reason}
    # undo the renaming: what is left is the template, unchanged
    template = _template_docs()
    for posted, kind in ((sts, "StatefulSet"), (svc, "Service")):
        text = json.dumps(posted).replace(f"switchboard-pp-{g}", "switchboard-pp-a")
        back = json.loads(text.replace(f'"{PIPELINE}": "{g}"', f'"{PIPELINE}": "a"'))
        del back["metadata"]["namespace"], back["metadata"]["labels"][MANAGED]
        back["metadata"].pop("annotations", None)
        assert back == template[kind]


async def test_kubernetes_groups_scale_statefulsets_from_the_real_template_on_a_fake_api_server(
    kube_stub: tuple[KubernetesObjectsStub, str],
) -> None:
    stub, url = kube_stub
    hand = _template_docs()  # group "a", applied by hand (kubectl apply -f group.yaml): not the autoscaler's
    stub.put("statefulsets", {**hand["StatefulSet"], "metadata": {**hand["StatefulSet"]["metadata"], "namespace": NS}})
    stub.put("services", hand["Service"])
    async with httpx.AsyncClient() as http:
        groups = KubernetesGroups(KubeClient(url, namespace=NS, token=TOKEN, http=http), GroupTemplate.load(GROUP_YAML))
        assert await groups.current() == 0

        await groups.scale_to(2, "min_replicas")
        assert [(r, o["metadata"]["name"]) for r, o in stub.posted] == [
            ("services", "switchboard-pp-0"), ("statefulsets", "switchboard-pp-0"),  # the Service first
            ("services", "switchboard-pp-1"), ("statefulsets", "switchboard-pp-1"),
        ]
        _check_kube_group(stub, 0, "min_replicas")
        _check_kube_group(stub, 1, "min_replicas")
        assert await groups.current() == 2

        await groups.scale_to(3, "waiting above target")
        assert [o["metadata"]["name"] for _, o in stub.posted[4:]] == ["switchboard-pp-2"] * 2
        _check_kube_group(stub, 2, "waiting above target")
        assert await groups.current() == 3

        await groups.scale_to(1, "low load")  # the highest ids first; the StatefulSet waits for its pods
        assert stub.deleted == [
            ("statefulsets", "switchboard-pp-2", "Foreground"), ("services", "switchboard-pp-2", "Background"),
            ("statefulsets", "switchboard-pp-1", "Foreground"), ("services", "switchboard-pp-1", "Background"),
        ]
        assert await groups.current() == 1  # groups being deleted do not count
        assert stub.names("statefulsets", live=False) == ["switchboard-pp-1", "switchboard-pp-2"]

        await groups.scale_to(2, "waiting above target")  # 1 and 2 still stopping: their names are taken
        assert stub.posted[-1][1]["metadata"]["name"] == "switchboard-pp-3"
        stub.finish_deletions()
        await groups.scale_to(3, "waiting above target")  # now the lowest free id again
        assert stub.posted[-1][1]["metadata"]["name"] == "switchboard-pp-1"
        _check_kube_group(stub, 3, "waiting above target")
        assert stub.names("statefulsets") == [f"switchboard-pp-{i}" for i in (0, 1, 3)] + ["switchboard-pp-a"]
        assert await groups.current() == 3
        with pytest.raises(ActuatorError, match="cannot scale to -1"):
            await groups.scale_to(-1, "nonsense")

        # API failures become ActuatorError
        stub.fail[("POST", "statefulsets")] = (
            403, "Forbidden", ('statefulsets.apps is forbidden: User "system:serviceaccount:switchboard:'
            'switchboard-control-plane" cannot create resource "statefulsets" in API group "apps"'),
        )
        with pytest.raises(ActuatorError, match=r"403: statefulsets.apps is forbidden"):
            await groups.scale_to(4, "waiting above target")
        del stub.fail[("POST", "statefulsets")]
        await groups.scale_to(4, "retry")  # its Service was left by the failed attempt: 409, taken as its own
        assert stub.names("services").count("switchboard-pp-2") == 1 and await groups.current() == 4
        stub.fail[("DELETE", "statefulsets")] = (500, "InternalError", "etcdserver: request timed out")
        with pytest.raises(ActuatorError, match="500: etcdserver: request timed out"):
            await groups.scale_to(3, "low load")
        for bad, match in [
            (KubeClient(url, namespace=NS, http=http), "401: Unauthorized"),
            (KubeClient(f"http://127.0.0.1:{free_port()}", namespace=NS, token=TOKEN, http=http), "ConnectError"),
        ]:
            with pytest.raises(ActuatorError, match=match):
                await KubernetesGroups(bad, GroupTemplate.load(GROUP_YAML)).current()


def test_kubernetes_group_template_is_checked_when_loaded(tmp_path: Path) -> None:
    with pytest.raises(ActuatorError, match="one StatefulSet and one Service"):
        GroupTemplate.load(ROOT / "deploy" / "kubernetes" / "base" / "shards.yaml")
    docs = _template_docs()
    del docs["StatefulSet"]["metadata"]["labels"][PIPELINE]
    (tmp_path / "g.yaml").write_text(yaml.safe_dump_all(docs.values()))
    with pytest.raises(ActuatorError, match="no switchboard.dev/pipeline label"):
        GroupTemplate.load(tmp_path / "g.yaml")
    with pytest.raises(ActuatorError, match="No such file"):
        GroupTemplate.load(tmp_path / "missing.yaml")


# -- a stub of Nomad's jobs API -------------------------------------------------------------------------


class NomadJobsStub:
    """A STUB of Nomad's jobs API: ``POST /v1/jobs/parse`` (through the FAKE parser of
    tests/support/nomad_hcl.py), register, list by prefix (meta with ``meta=true``), deregister (the job
    stays, ``Stop`` true and still running, until :meth:`finish_stops` makes it dead); the ACL token and
    the namespace checked on every call; errors as Nomad's plain-text bodies."""

    def __init__(self, namespace: str = "serving", token: str = "s3cret") -> None:
        self.namespace, self.token = namespace, token
        self.jobs: dict[str, dict[str, Any]] = {}  # ID -> {"Job", "Stop", "Status"}
        self.parsed: list[dict[str, Any]] = []
        self.registered: list[dict[str, Any]] = []
        self.deregistered: list[str] = []
        self.fail: dict[str, tuple[int, str]] = {}  # "parse" | "register" | "list" | "deregister" -> code, text
        self.index = 100
        self.app = FastAPI()
        self.app.post("/v1/jobs/parse")(self._parse)
        self.app.post("/v1/jobs")(self._register)
        self.app.get("/v1/jobs")(self._list)
        self.app.delete("/v1/job/{job_id}")(self._deregister)

    def finish_stops(self) -> None:
        for job in self.jobs.values():
            if job["Stop"]:
                job["Status"] = "dead"

    def _refuse(self, request: Request, call: str) -> PlainTextResponse | None:
        if request.headers.get("X-Nomad-Token") != self.token:
            return PlainTextResponse("Permission denied", status_code=403)
        if call != "parse" and request.query_params.get("namespace", "default") != self.namespace:
            return PlainTextResponse("namespace not found", status_code=404)
        if call in self.fail:
            code, text = self.fail[call]
            return PlainTextResponse(text, status_code=code)
        return None

    def _eval(self) -> dict[str, Any]:
        self.index += 1
        return {"EvalID": str(uuid.uuid4()), "EvalCreateIndex": self.index, "JobModifyIndex": self.index,
                "Warnings": "", "Index": self.index, "LastContact": 0, "KnownLeader": False}

    async def _parse(self, request: Request) -> Any:
        if (error := self._refuse(request, "parse")) is not None:
            return error
        body = await request.json()
        self.parsed.append(body)
        return parse_job(body["JobHCL"])

    async def _register(self, request: Request) -> Any:
        if (error := self._refuse(request, "register")) is not None:
            return error
        job = (await request.json())["Job"]
        self.registered.append(job)
        self.jobs[job["ID"]] = {"Job": job, "Stop": False, "Status": "running"}
        return self._eval()

    async def _list(self, request: Request) -> Any:
        if (error := self._refuse(request, "list")) is not None:
            return error
        prefix, meta = request.query_params.get("prefix", ""), request.query_params.get("meta") == "true"
        return [
            {"ID": i, "Name": i, "Namespace": self.namespace, "Type": "service", "Status": j["Status"],
             "Stop": j["Stop"], **({"Meta": j["Job"].get("Meta")} if meta else {})}
            for i, j in sorted(self.jobs.items()) if i.startswith(prefix)
        ]

    async def _deregister(self, request: Request, job_id: str) -> Any:
        if (error := self._refuse(request, "deregister")) is not None:
            return error
        if job_id not in self.jobs:
            return PlainTextResponse("job not found", status_code=404)
        self.deregistered.append(job_id)
        self.jobs[job_id]["Stop"] = True
        return self._eval()


@pytest.fixture
def nomad_stub() -> Iterator[tuple[NomadJobsStub, str]]:
    stub = NomadJobsStub()
    with serve_app(stub.app) as url:
        yield stub, url


NOMAD_ENV = {"NOMAD_IP_http": "10.0.0.1", "NOMAD_PORT_http": "25000", "NOMAD_IP_pipeline": "10.0.0.1",
             "NOMAD_PORT_pipeline": "25001", "node.datacenter": "dc1"}


def _nomad_filled(word: str) -> str:
    """`word` with Nomad's runtime interpolations given example values."""
    return re.sub(r"\$\{([\w.]+)\}", lambda m: NOMAD_ENV[m.group(1)], word)


def _check_nomad_group(job: dict[str, Any], g: int) -> None:
    """Group g's registered job is the parsed template, renamed for g, with the control plane's meta."""
    name = f"switchboard-pp-{g}"
    assert job["ID"] == job["Name"] == name
    assert job["Meta"] == {"switchboard_pipeline_group": str(g), "switchboard_managed_by": "switchboard-control-plane"}
    assert job["Constraints"] == [{"LTarget": "", "RTarget": "true", "Operand": "distinct_hosts"}]
    stage0, stage1 = job["TaskGroups"]
    assert [s["Name"] for s in stage0["Services"]] == ["switchboard-shard", f"{name}-store"]
    templates = {t["DestPath"]: t for t in stage1["Tasks"][0]["Templates"]}
    assert set(templates) == {"local/join.env", "secrets/cluster.env"}  # the join address; the cluster token
    tmpl = templates["local/join.env"]  # stage 1 joins this group's stage 0
    assert f'range service "{name}-store"' in tmpl["EmbeddedTmpl"]
    args = [_nomad_filled(a) for a in stage0["Tasks"][0]["Config"]["args"]]
    assert args[0] == "shard"
    shard = parse_settings(ShardSettings, args[1:], "switchboard shard")
    assert shard.pipeline_parallel_size == 2 and shard.pipeline_remote_stages == "1"
    stage = join_parser().parse_args(stage1["Tasks"][0]["Config"]["args"][1:])
    assert (stage.rank, stage.join) == (1, "${JOIN}")
    back = json.loads(json.dumps({**job, "Meta": None}).replace(name, "switchboard-pp-a"))
    assert back == parse_job(GROUP_HCL.read_text())  # nothing else changed


async def test_nomad_groups_register_jobs_from_the_real_job_file_on_a_fake_nomad(
    nomad_stub: tuple[NomadJobsStub, str],
) -> None:
    stub, url = nomad_stub
    async with httpx.AsyncClient() as http:
        api = NomadClient(http, addr=url, namespace="serving", token="s3cret")
        groups = NomadGroups(api, GROUP_HCL)
        assert await groups.current() == 0
        assert stub.parsed == [{"JobHCL": GROUP_HCL.read_text(), "Canonicalize": True}]

        await groups.scale_to(2, "min_replicas")
        assert [j["ID"] for j in stub.registered] == ["switchboard-pp-0", "switchboard-pp-1"]
        _check_nomad_group(stub.registered[0], 0)
        _check_nomad_group(stub.registered[1], 1)
        await groups.scale_to(3, "waiting above target")
        assert stub.registered[-1]["ID"] == "switchboard-pp-2" and await groups.current() == 3

        await groups.scale_to(1, "low load")
        assert stub.deregistered == ["switchboard-pp-2", "switchboard-pp-1"]
        assert await groups.current() == 1  # stopped jobs do not count, still-stopping ones keep their ID
        await groups.scale_to(2, "waiting above target")
        assert stub.registered[-1]["ID"] == "switchboard-pp-3"
        stub.finish_stops()  # dead: the ID is free, registering it again revives the job
        await groups.scale_to(3, "waiting above target")
        assert stub.registered[-1]["ID"] == "switchboard-pp-1" and stub.jobs["switchboard-pp-1"]["Stop"] is False
        _check_nomad_group(stub.registered[-1], 1)
        assert len(stub.parsed) == 1  # the job file is parsed once

        # a job of a group's name that the control plane did not register: not counted, not replaced
        stub.jobs["switchboard-pp-2"] = {"Job": {"ID": "switchboard-pp-2", "Meta": {"owner": "ops"}},
                                         "Stop": False, "Status": "running"}
        assert await groups.current() == 3
        await groups.scale_to(4, "waiting above target")
        assert stub.registered[-1]["ID"] == "switchboard-pp-4"
        await groups.scale_to(0, "idle")
        assert stub.deregistered[-4:] == [f"switchboard-pp-{i}" for i in (4, 3, 1, 0)]

        # failures become ActuatorError
        stub.fail["register"] = (500, "rpc error: No cluster leader")
        with pytest.raises(ActuatorError, match="500: rpc error: No cluster leader"):
            await groups.scale_to(1, "min_replicas")
        fresh = NomadGroups(api, GROUP_HCL)
        stub.fail["parse"] = (400, 'input.hcl:27,1-4: Unsupported block type; Blocks of type "jbo" are not expected')
        with pytest.raises(ActuatorError, match="400: input.hcl:27,1-4: Unsupported block type"):
            await fresh.current()
        for bad, match in [
            (NomadClient(http, addr=url, namespace="serving", token="wrong"), "403: Permission denied"),
            (NomadClient(http, addr=f"http://127.0.0.1:{free_port()}"), "ConnectError"),
        ]:
            with pytest.raises(ActuatorError, match=match):
                await NomadGroups(bad, GROUP_HCL).current()


async def test_nomad_groups_take_the_json_job_form_without_parsing(
    nomad_stub: tuple[NomadJobsStub, str], tmp_path: Path
) -> None:
    stub, url = nomad_stub
    job_json = tmp_path / "group.json"  # as `nomad job run -output FILE` prints it
    job_json.write_text(json.dumps({"Job": parse_job(GROUP_HCL.read_text())}))
    async with httpx.AsyncClient() as http:
        groups = NomadGroups(NomadClient(http, addr=url, namespace="serving", token="s3cret"), job_json)
        await groups.scale_to(1, "min_replicas")
    assert stub.parsed == [] and [j["ID"] for j in stub.registered] == ["switchboard-pp-0"]
    _check_nomad_group(stub.registered[0], 0)


async def test_the_template_setting_picks_the_group_actuators(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": NS}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
    }))
    kube = ControlPlaneSettings(actuator="kubernetes", kubeconfig=kubeconfig, pipeline_group_template=GROUP_YAML)
    nomad = ControlPlaneSettings(actuator="nomad", pipeline_group_template=GROUP_HCL)
    async with httpx.AsyncClient() as http:
        for settings, kind in ((kube, KubernetesGroups), (nomad, NomadGroups)):
            actuator = build_actuator(settings, http)
            assert isinstance(actuator, kind)
            await actuator.aclose()
    with pytest.raises(ValidationError, match="for the kubernetes and nomad actuators"):
        ControlPlaneSettings(actuator="local", pipeline_group_template=GROUP_YAML)
