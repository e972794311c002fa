"""The Kubernetes specs as an API server and its controllers would take them, without a cluster.

Every object `kubectl apply -k` would send (the base and both overlays, built by tests/support/kustomize.py)
and every object the group actuator POSTs (a pipeline group rendered from its template) validates
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an unknown or misspelt field fails),
for the oldest and the newest release the package knows. Then what the schemas cannot see and a
cluster would only show as pods that never become ready or a Service with no endpoints: selectors that
select their own pods, Services whose target ports are container ports of the pods they select, a
StatefulSet's governing Service, and every ConfigMap, Secret key, ServiceAccount and Role a spec names
existing in the build (or, for the one Secret the operator creates, in the documented command)."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from control_plane.scaling.actuators.kubernetes_groups import GroupTemplate
from tests.support.kustomize import Obj, build, pod_spec
from tests.support.procs import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ("", "pipeline", "pipeline-nodes")
VERSIONS = ("1.31", kubernetes_validate.latest_version())
NAMESPACE = "switchboard"


def _group_objects() -> list[Obj]:
    template = GroupTemplate.load(KUBE / "pipeline-nodes" / "group.yaml")
    return [obj for gid in (0, 7) for obj in template.for_group(gid, NAMESPACE)]


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "base")
def test_every_object_of_every_variant_passes_the_api_schemas(variant: str) -> None:
    objs = build(KUBE / variant) if variant else build(KUBE)
    assert len({_key(o) for o in objs}) == len(objs), "two objects share a kind and name"
    for obj in objs + (_group_objects() if variant == "pipeline-nodes" else []):
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_group_template_renders_one_group_per_id() -> None:
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in _group_objects()]
    assert names == [("StatefulSet", "switchboard-pp-0"), ("Service", "switchboard-pp-0"),
                     ("StatefulSet", "switchboard-pp-7"), ("Service", "switchboard-pp-7")]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _documented_secret_keys() -> dict[str, set[str]]:
    """Secret -> keys, from the `kubectl create secret generic` the top kustomization tells operators to run."""
    out: dict[str, set[str]] = {}
    for command in re.findall(r"create secret generic .*?[^\\]\n", (KUBE / "kustomization.yaml").read_text(), re.DOTALL):
        out[command.split()[3]] = set(re.findall(r"--from-literal=([\w.-]+)=", command))
    return out


def _check_references(objs: list[Obj], extra_workloads: list[Obj] = ()) -> None:  # type: ignore[assignment]
    by_key = {_key(o): o for o in objs}
    secrets = _documented_secret_keys()
    workloads = [o for o in [*objs, *extra_workloads] if pod_spec(o) is not None]
    assert workloads
    for w in workloads:
        where = _key(w)
        assert w["metadata"].get("namespace") == NAMESPACE, where
        template_labels = w["spec"]["template"]["metadata"]["labels"]
        assert _selects(w["spec"]["selector"]["matchLabels"], template_labels), f"{where}: selector misses its pods"
        pod = pod_spec(w)
        assert pod is not None
        if w["kind"] == "StatefulSet":
            governing = by_key.get(("Service", w["spec"]["serviceName"]))
            if governing is None:  # a group's own Service travels with it
                governing = next(o for o in extra_workloads if _key(o) == ("Service", w["spec"]["serviceName"]))
            assert governing["spec"].get("clusterIP") == "None", f"{where}: governing Service is not headless"
            assert _selects(governing["spec"]["selector"], template_labels), where
        if "serviceAccountName" in pod:
            assert ("ServiceAccount", pod["serviceAccountName"]) in by_key, where
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in by_key, (where, volume)
        for c in pod["containers"]:
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
                assert port is None or port in ports or isinstance(port, int), (where, probe, port)
            for ref in c.get("envFrom", []):
                assert ("ConfigMap", ref["configMapRef"]["name"]) in by_key, (where, ref)
            for env in c.get("env", []):
                source = env.get("valueFrom") or {}
                if "configMapKeyRef" in source:
                    cm = by_key[("ConfigMap", source["configMapKeyRef"]["name"])]
                    assert source["configMapKeyRef"]["key"] in cm["data"], (where, env["name"])
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    assert ref["key"] in secrets.get(ref["name"], set()), (where, env["name"], secrets)
    for svc in [o for o in [*objs, *extra_workloads] if o["kind"] == "Service"]:
        pods = [w for w in workloads if _selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert pods, f"{_key(svc)} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            declared = [(p.get("name"), p["containerPort"]) for w in pods for c in (pod_spec(w) or {})["containers"]
                        for p in c.get("ports", [])]
            assert any(target in pair for pair in declared), (_key(svc), target, declared)
    for binding in [o for o in objs if o["kind"] == "RoleBinding"]:
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in by_key, _key(binding)
        for subject in binding["subjects"]:
            assert ("ServiceAccount", subject["name"]) in by_key and subject.get("namespace") == NAMESPACE, subject


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "base")
def test_every_reference_in_a_variant_resolves_as_a_cluster_would(variant: str) -> None:
    objs = build(KUBE / variant) if variant else build(KUBE)
    _check_references(objs, _group_objects() if variant == "pipeline-nodes" else [])


def test_the_reference_checks_catch_what_the_schemas_do_not() -> None:
    """The checks above fail on the mistakes they are for (each is valid to the schemas)."""
    def broken(edit: Any) -> list[Obj]:
        objs = build(KUBE)
        edit({_key(o): o for o in objs})
        return objs

    mistakes = [
        lambda o: o[("Service", "switchboard-gateway")]["spec"]["ports"][0].update(targetPort="web"),
        lambda o: o[("Service", "switchboard-cache")]["spec"]["selector"].update({"app.kubernetes.io/name": "cache"}),
        lambda o: o[("Deployment", "switchboard-shard")]["spec"]["template"]["spec"]["containers"][0]["envFrom"][0][
            "configMapRef"].update(name="switchboard-settings"),
        lambda o: o[("Deployment", "switchboard-gateway")]["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "switchboard-secrets", "key": "admin_token"}}}),
        lambda o: o[("StatefulSet", "switchboard-cache")]["spec"].update(serviceName="switchboard-gateway"),
    ]
    for mistake in mistakes:
        objs = broken(mistake)
        for obj in objs:
            kubernetes_validate.validate(obj, VERSIONS[0], strict=True)
        with pytest.raises((AssertionError, KeyError, StopIteration)):
            _check_references(objs)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (its kustomize builds them)")
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "base")
def test_the_python_build_is_kubectls_own(variant: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / variant)], check=True, capture_output=True, text=True,
                         timeout=60)
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]

    def unhashed(objs: list[Obj]) -> list[Obj]:  # generated names carry a content hash in kubectl's build
        text = yaml.safe_dump(sorted(objs, key=_key), sort_keys=True)
        return yaml.safe_load(re.sub(r"(switchboard-pipeline-group)-[a-z0-9]{10}", r"\1", text))

    assert unhashed(theirs) == unhashed(build(KUBE / variant) if variant else build(KUBE))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "base")
def test_every_process_that_serves_metrics_holds_the_metrics_token(variant: str) -> None:
    """Every /metrics is guarded: Prometheus holds the metrics token (prometheus.example.yml), so a process
    without it in its environment would answer its scrapes 401 (it would still take the cluster token)."""
    objs = build(KUBE / variant) if variant else build(KUBE)
    workloads = [o for o in objs + (_group_objects() if variant == "pipeline-nodes" else []) if pod_spec(o)]
    assert workloads
    for w in workloads:
        for c in (pod_spec(w) or {})["containers"]:
            refs = {e["name"]: (e.get("valueFrom") or {}).get("secretKeyRef") for e in c.get("env", [])}
            if "SWITCHBOARD_CLUSTER_TOKEN" in refs:
                ref = refs.get("SWITCHBOARD_METRICS_TOKEN")
                assert ref == {"name": "switchboard-secrets", "key": "metrics-token", "optional": True}, (_key(w), ref)


def test_the_example_scrape_config_presents_the_metrics_token_under_the_rules_job_names() -> None:
    from dashboards.catalogue import JOBS

    config = yaml.safe_load((KUBE / "prometheus.example.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == set(JOBS.values())
    for job in jobs.values():
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "/etc/prometheus/switchboard/metrics-token"}
    # promtool checks it in tests/observability/test_kubernetes_prometheus.py (Debian's lacks Kubernetes SD)
