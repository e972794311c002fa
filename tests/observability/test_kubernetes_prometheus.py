"""deploy/kubernetes/prometheus.example.yml: the scrape config an operator copies for Kubernetes.

It found gateways, shards and cache nodes through the control plane's membership SD only, so a member that
died left its targets, and SwitchboardShardDown / CacheNodeDown / GatewayDown could never fire there. Its
member jobs now discover pods (kubernetes_sd_configs, role pod) by the labels the manifests set.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability.exprs import RULE_FILES, rules
from tests.observability.test_rules import PROMTOOL, needs_promtool, promtool
from tests.support.procs import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
EXAMPLE = KUBERNETES / "prometheus.example.yml"
TOKEN_FILE = "/etc/prometheus/switchboard/metrics-token"
MEMBER_JOBS = {"switchboard-gateway", "switchboard-shard", "switchboard-cache"}


def config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return loaded


def built_with_kubernetes_sd(tmp_path: Path) -> bool:
    probe = tmp_path / "probe.yml"
    probe.write_text("scrape_configs: [{job_name: p, kubernetes_sd_configs: [{role: pod}]}]\n")
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "config", str(probe)], check=False, capture_output=True,
                          timeout=60).returncode == 0


@needs_promtool
def test_promtool_accepts_it(tmp_path: Path) -> None:
    """promtool checks that the credentials file exists: an operator's copy, beside its token file. Debian's
    prometheus is built without Kubernetes discovery ("field kubernetes_sd_configs not found"): there each
    pod discovery is checked as a static target list instead, and everything else as written."""
    token = tmp_path / "metrics-token"
    token.write_text("sb-metrics-example\n")
    text = EXAMPLE.read_text().replace(TOKEN_FILE, str(token))
    if not built_with_kubernetes_sd(tmp_path):
        doc = yaml.safe_load(text)
        for job in doc["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["10.0.0.7:8000"]}]
        text = yaml.safe_dump(doc)
    (tmp_path / "prometheus.yml").write_text(text)
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)


def test_every_job_the_rules_name_is_scraped() -> None:
    named = {job for path in RULE_FILES for rule in rules(path)
             for job in re.findall(r'job\s*=\s*"([^"]+)"', rule["expr"])}
    jobs = {job["job_name"] for job in config()["scrape_configs"]}
    assert named and named <= jobs, named - jobs


def pod_templates() -> list[tuple[str, str, list[str]]]:
    """(app.kubernetes.io/name, the first pod's name, its containers' port names) of every workload the
    manifests define."""
    out = []
    for path in KUBERNETES.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc or {}).get("spec", {}).get("template") if isinstance(doc, dict) else None
            if not template:
                continue
            name = template["metadata"]["labels"]["app.kubernetes.io/name"]
            pod = doc["metadata"]["name"] + ("-0" if doc["kind"] == "StatefulSet" else "-7d9f-x2x")
            ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
            out.append((name, pod, ports))
    return out


def kept(job: dict[str, Any], meta: dict[str, str]) -> bool:
    """Prometheus' keep/drop relabelling of one discovered target (the actions this file uses)."""
    for rule in job.get("relabel_configs", []):
        value = rule.get("separator", ";").join(meta.get(label, "") for label in rule["source_labels"])
        matched = re.fullmatch(rule.get("regex", "(.*)"), value) is not None
        if (rule.get("action", "replace") == "keep" and not matched) or (rule.get("action") == "drop" and matched):
            return False
    return True


def test_members_are_found_as_pods_by_the_manifests_labels() -> None:
    jobs = {job["job_name"]: job for job in config()["scrape_configs"]}
    for name in MEMBER_JOBS:
        job = jobs[name]
        assert "http_sd_configs" not in job, f"{name}: membership SD drops a dead member's target"
        assert [sd["role"] for sd in job["kubernetes_sd_configs"]] == ["pod"]
    found: dict[str, int] = {}
    for app, pod, ports in pod_templates():
        for port in ports:
            meta = {"__meta_kubernetes_pod_label_app_kubernetes_io_name": app, "__meta_kubernetes_pod_name": pod,
                    "__meta_kubernetes_pod_container_port_name": port, "__meta_kubernetes_pod_phase": "Running"}
            for name in MEMBER_JOBS:
                if kept(jobs[name], meta):
                    assert port == "http", (name, app, port)
                    found[name] = found.get(name, 0) + 1
            if app == "switchboard-pp":  # a group's other pods run stages: no /metrics to scrape
                assert not any(kept(jobs[n], {**meta, "__meta_kubernetes_pod_name": pod[:-1] + "1"})
                               for n in MEMBER_JOBS)
            evicted = {**meta, "__meta_kubernetes_pod_phase": "Failed"}
            assert not any(kept(jobs[n], evicted) for n in MEMBER_JOBS)
    assert set(found) == MEMBER_JOBS, found


def test_prometheus_may_list_the_pods() -> None:
    role, binding = yaml.safe_load_all((KUBERNETES / "prometheus-rbac.example.yaml").read_text())
    namespaces = {ns for job in config()["scrape_configs"] for sd in job.get("kubernetes_sd_configs", [])
                  for ns in sd["namespaces"]["names"]}
    assert {role["metadata"]["namespace"], binding["metadata"]["namespace"]} == namespaces
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
