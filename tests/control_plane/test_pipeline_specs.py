"""The Kubernetes and Nomad specs place a pipelined shard as one group: the flags they add are ones
the shard's own parser accepts, and the resources they ask for are N stages' worth (docs/SHARDING.md).
The specs that place one stage per node (a StatefulSet per group; a Nomad job with a task group per
stage and distinct_hosts) run `switchboard shard` on stage 0 and `switchboard stage --join` on the
others with flags the real parsers accept, consistent with each other (stage count, ranks, the
address stage 0 listens on and the one the others join). The pipeline-nodes overlay hands group.yaml
to the control plane as its group template, with the RBAC the group actuator's calls need; and
kustomize builds the base and both overlays (when kubectl is installed)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from control_plane.app import parse_settings as parse_control_plane
from control_plane.scaling.actuators.kubernetes_groups import GroupTemplate
from data_plane.common.settings_cli import parse_settings
from data_plane.shard.engines.pipeline_stage import join_parser
from data_plane.shard.settings import ShardSettings
from tests.support.procs import ROOT

DEPLOY = ROOT / "deploy"


def test_kubernetes_overlay_makes_each_replica_a_whole_group() -> None:
    overlay = yaml.safe_load((DEPLOY / "kubernetes" / "pipeline" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base"]
    (patch,) = overlay["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == "switchboard-shard"
    ops = yaml.safe_load(patch["patch"])
    added = [op["value"] for op in ops if op["op"] == "add" and op["path"].endswith("/args/-")]
    base = yaml.safe_load_all((DEPLOY / "kubernetes" / "base" / "shards.yaml").read_text())
    (deployment,) = [d for d in base if d and d["kind"] == "Deployment"]
    args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:] if "$(" not in a]
    settings = parse_settings(ShardSettings, args + added, "switchboard shard")
    (resources,) = [op["value"] for op in ops if op["path"].endswith("/resources")]
    assert int(resources["requests"]["cpu"]) == settings.pipeline_parallel_size * settings.threads == 4


def test_nomad_group_runs_n_stages_with_n_stages_of_cpu() -> None:
    hcl = (DEPLOY / "nomad" / "switchboard.nomad.hcl").read_text()
    group = hcl[hcl.index('group "shard"'):]
    args = re.search(r"args = \[(.*?)\]", group, re.DOTALL)
    assert args is not None
    flat = [a.strip().strip('"') for a in args.group(1).split(",") if a.strip()]
    assert flat[flat.index("--pipeline-parallel-size") + 1] == "${var.shard_pipeline_parallel_size}"
    assert flat[flat.index("--threads") + 1] == "${var.shard_threads_per_stage}"
    assert "cpu    = 1000 * var.shard_threads_per_stage * var.shard_pipeline_parallel_size" in group
    assert 'pipeline_parallel_size = "${var.shard_pipeline_parallel_size}"' in group  # Consul meta
    # with the variables' defaults the flags parse as the shard's own
    defaults = {"shard_pipeline_parallel_size": "1", "shard_threads_per_stage": "4"}
    for name, value in defaults.items():
        assert re.search(rf'variable "{name}" {{[^}}]*default\s*=\s*{value}', hcl)
    parse_settings(ShardSettings, ["--pipeline-parallel-size", "2", "--threads", "4"], "switchboard shard")


POD_IP, NODE_IP = "10.0.0.7", "10.0.0.8"


def _filled(word: str, env: dict[str, str]) -> str:
    """A spec's word with its variables ($X, ${X}, ${attr.x}) given example values."""
    return re.sub(r"\$\{?([\w.\-]+)\}?", lambda m: env[m.group(1)], word)


def _exec_lines(script: str, env: dict[str, str]) -> dict[str, list[str]]:
    """The flags of each `exec switchboard <command> ...` in a shell script, by command."""
    out = {}
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:2] == ["exec", "switchboard"]:
            out[words[2]] = [_filled(w, env) for w in words[3:]]
    return out


def test_kubernetes_statefulset_places_one_stage_per_node() -> None:
    here = DEPLOY / "kubernetes" / "pipeline-nodes"
    docs = [d for d in yaml.safe_load_all((here / "group.yaml").read_text()) if d]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    spec, pod = sts["spec"], sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    # a headless service names stage 0 before it is ready; every stage starts at once
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"] == labels
    assert spec["serviceName"] == svc["metadata"]["name"] and spec["podManagementPolicy"] == "Parallel"
    # no two stages of the group on one node
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == labels
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    script = container["args"][0]
    assert 'RANK="${HOSTNAME##*-}"' in script  # a pod's ordinal is its stage
    assert script.index('if [ "$RANK" = 0 ]') < script.index("exec switchboard shard") < script.index("fi\n")
    env = {"POD_IP": POD_IP, "HOST_IP": NODE_IP, "POD_NAME": sts["metadata"]["name"] + "-0", "RANK": "1"}
    cmds = _exec_lines(script, env)
    shard = parse_settings(ShardSettings, cmds["shard"], "switchboard shard")  # stage 0, the real parser
    n = spec["replicas"]
    assert shard.pipeline_parallel_size == n == 2
    assert shard.pipeline_remote_stages == ",".join(str(i) for i in range(1, n))
    assert shard.pipeline_host == shard.host == POD_IP
    stage = join_parser().parse_args(cmds["stage"])  # the others: unknown flags exit 2
    host, port = stage.join.rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    (svc_port,) = svc["spec"]["ports"]
    assert int(port) == shard.pipeline_port == svc_port["port"]
    assert (stage.rank, stage.bind) == (1, POD_IP)


def _nomad_group(hcl: str, name: str) -> str:
    start = hcl.index(f'\n  group "{name}" {{')
    end = hcl.find('\n  group "', start + 1)
    return hcl[start:end if end > 0 else len(hcl)]


def _nomad_args(block: str, env: dict[str, str]) -> list[str]:
    args = re.search(r"args = \[(.*?)\]", block, re.DOTALL)
    assert args is not None
    return [_filled(a.strip().strip('"'), env) for a in args.group(1).split(",") if a.strip()]


def test_nomad_job_places_one_stage_per_node() -> None:
    hcl = (DEPLOY / "nomad" / "switchboard-pipeline.nomad.hcl").read_text()
    job = hcl[hcl.index("\njob "):hcl.index("\n  group ")]
    assert re.search(r'constraint \{\s*operator = "distinct_hosts"\s*value\s*= "true"\s*\}', job)  # the whole job
    groups = re.findall(r'\n  group "([\w-]+)" \{', hcl)
    n = len(groups)
    assert n >= 2 and groups == [f"stage{i}" for i in range(n)]
    env = {"NOMAD_IP_http": NODE_IP, "NOMAD_PORT_http": "25000", "NOMAD_IP_pipeline": NODE_IP,
           "NOMAD_PORT_pipeline": "25001", "var.threads_per_stage": "4", "node.datacenter": "dc1",
           "attr.unique.network.ip-address": "10.0.0.9", "JOIN": f"{NODE_IP}:25001"}
    zero = _nomad_group(hcl, "stage0")
    args = _nomad_args(zero, env)
    assert args[0] == "shard"
    shard = parse_settings(ShardSettings, args[1:], "switchboard shard")
    assert shard.pipeline_parallel_size == n and shard.pipeline_remote_stages == ",".join(map(str, range(1, n)))
    assert (shard.pipeline_host, shard.pipeline_port) == (NODE_IP, 25001)
    store = re.search(r'name\s*=\s*"([\w-]+-store)"\s*port\s*=\s*"pipeline"', zero)
    assert store is not None  # stage 0's pipeline port, registered in Consul for the others
    for i in range(n):
        assert re.search(r"count = 1\b", _nomad_group(hcl, f"stage{i}"))
    for i in range(1, n):
        block = _nomad_group(hcl, f"stage{i}")
        args = _nomad_args(block, env)
        assert args[0] == "stage"
        stage = join_parser().parse_args(args[1:])
        assert (stage.rank, stage.join) == (i, f"{NODE_IP}:25001")
        assert f'JOIN={{{{ range service "{store.group(1)}" }}}}{{{{ .Address }}}}:{{{{ .Port }}}}' in block
        assert "env         = true" in block and "${JOIN}" in block


def _docs(path: Path) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text()) if d}


def test_kubernetes_pipeline_nodes_overlay_lets_the_control_plane_scale_groups(monkeypatch, tmp_path) -> None:
    here, base = DEPLOY / "kubernetes" / "pipeline-nodes", DEPLOY / "kubernetes" / "base"
    overlay = yaml.safe_load((here / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base", "rbac.yaml"]  # group.yaml is no resource: a template
    (generator,) = overlay["configMapGenerator"]
    assert generator["files"] == ["group.yaml"]
    delete, wiring = overlay["patches"]
    assert yaml.safe_load(delete["patch"]) == {
        "$patch": "delete", "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "switchboard-shard"}
    }
    assert wiring["target"]["name"] == "switchboard-control-plane"
    ops = {op["path"].split("/")[-2]: op["value"] for op in yaml.safe_load(wiring["patch"])}
    flag, _, path = ops["args"].partition("=")
    assert flag == "--pipeline-group-template"
    assert ops["volumes"] == {"name": ops["volumeMounts"]["name"], "configMap": {"name": generator["name"]}}
    assert Path(path) == Path(ops["volumeMounts"]["mountPath"]) / "group.yaml"  # the ConfigMap's key
    # the control plane's own parser, with the base's settings and the added flag
    base_docs = _docs(base / "control-plane.yaml")
    for key, value in _docs(base / "configmap.yaml")[("ConfigMap", "switchboard-config")]["data"].items():
        monkeypatch.setenv(key, value)
    deployment = base_docs[("Deployment", "switchboard-control-plane")]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    # the mounted file, here under tmp_path: the parser checks that a file it is given is there
    mounted = tmp_path / path.lstrip("/")
    mounted.parent.mkdir(parents=True)
    mounted.write_text((here / "group.yaml").read_text())
    settings = parse_control_plane([re.sub(r"\$\((\w+)\)", "10.0.0.1", a) for a in args[1:]]
                                   + [f"{flag}={mounted}"])
    assert settings.autoscale and settings.actuator == "kubernetes" and settings.pipeline_group_template == mounted
    # the template loads, and names its full image (kustomize does not rewrite a ConfigMap's file)
    GroupTemplate.load(here / "group.yaml")
    (image,) = overlay["images"]
    (container,) = _docs(here / "group.yaml")[("StatefulSet", "switchboard-pp-a")]["spec"]["template"]["spec"][
        "containers"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
    # RBAC: what KubernetesGroups calls, for the control plane's service account
    rbac = _docs(here / "rbac.yaml")
    (role,) = [d for (kind, _), d in rbac.items() if kind == "Role"]
    (binding,) = [d for (kind, _), d in rbac.items() if kind == "RoleBinding"]
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants == {("apps", "statefulsets"): {"list", "create", "delete"}, ("", "services"): {"create", "delete"}}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": deployment["spec"]["template"]["spec"][
        "serviceAccountName"]}]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (its kustomize builds them)")
def test_kustomize_builds_the_base_and_both_overlays() -> None:
    built = {}
    for name in ("", "pipeline", "pipeline-nodes"):
        out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "kubernetes" / name)],
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        built[name] = [d for d in yaml.safe_load_all(out.stdout) if d]
    deployments = {d["metadata"]["name"]: d for d in built["pipeline-nodes"] if d["kind"] == "Deployment"}
    assert "switchboard-shard" not in deployments and "switchboard-shard" in {
        d["metadata"]["name"] for d in built[""] if d["kind"] == "Deployment"}
    (config_map,) = [d for d in built["pipeline-nodes"]
                     if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("switchboard-pipeline-group-")]
    assert config_map["data"]["group.yaml"] == (DEPLOY / "kubernetes" / "pipeline-nodes" / "group.yaml").read_text()
    volumes = deployments["switchboard-control-plane"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "pipeline-group", "configMap": {"name": config_map["metadata"]["name"]}} in volumes


def test_every_process_in_the_specs_holds_the_cluster_token_from_a_secret() -> None:
    """Cache nodes without SWITCHBOARD_CLUSTER_TOKEN serve transcripts to anyone on their port, and a
    pipeline stage without it is refused by stage 0: every container and task of every spec gets it,
    from the Secret / Nomad variable, never as a literal."""
    containers = []
    for path in [*(DEPLOY / "kubernetes" / "base").glob("*.yaml"), DEPLOY / "kubernetes" / "pipeline-nodes" / "group.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            containers += [(path.name, c) for c in spec.get("containers", [])]
    assert {c["name"] for _, c in containers} >= {"gateway", "shard", "cache-node", "control-plane", "stage"}
    for name, c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        assert env.get("SWITCHBOARD_CLUSTER_TOKEN", {}).get("valueFrom") == {
            "secretKeyRef": {"name": "switchboard-secrets", "key": "cluster-token"}}, (name, c["name"])
    assert "--from-literal=cluster-token=" in (DEPLOY / "kubernetes" / "kustomization.yaml").read_text()
    for path in (DEPLOY / "nomad").glob("*.nomad.hcl"):
        tasks = re.split(r'\n\s*task "', path.read_text())[1:]
        assert tasks, path.name
        for task in tasks:
            assert ('{{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}'
                    in task), (path.name, task.split('"', 1)[0])
        # a variable without cluster_token stops the task instead of rendering "<no value>" as the token
        blocks = re.findall(r"template \{(.*?)\n\s*\}", path.read_text(), re.DOTALL)
        cluster = [b for b in blocks if ".cluster_token" in b]
        assert cluster and all(re.search(r"error_on_missing_key\s*=\s*true", b) for b in cluster), path.name


OPTIONAL_METRICS_TOKEN = re.compile(
    r'\{\{ with nomadVar "nomad/jobs/switchboard" \}\}\{\{ range \$k, \$v := \. \}\}\{\{ if eq \$k "metrics_token" \}\}'
    r"SWITCHBOARD_METRICS_TOKEN=\{\{ \$v \}\}\{\{ end \}\}\{\{ end \}\}\{\{ end \}\}")
"""The Nomad template line of an optional key: ranging over the variable's items reads no missing key, so
error_on_missing_key (there for the cluster token) does not stop a task whose variable lacks it, and the
line renders empty then (consul-template: nomadVar gives a map of its items)."""


def test_every_process_in_the_specs_gets_the_optional_metrics_token() -> None:
    """Kubernetes read the Secret's optional `metrics-token` into SWITCHBOARD_METRICS_TOKEN in every container;
    the Nomad jobs had no metrics_token at all (a comment said to add it by hand to each task), so Prometheus
    could scrape a Nomad install only with the cluster token, which also joins the registry and calls shards."""
    for path in [*(DEPLOY / "kubernetes" / "base").glob("*.yaml"), DEPLOY / "kubernetes" / "pipeline-nodes" / "group.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                env = {e["name"]: e for e in c.get("env", [])}
                assert env.get("SWITCHBOARD_METRICS_TOKEN", {}).get("valueFrom") == {"secretKeyRef": {
                    "name": "switchboard-secrets", "key": "metrics-token", "optional": True}}, (path.name, c["name"])
    for path in (DEPLOY / "nomad").glob("*.nomad.hcl"):
        text = path.read_text()
        tasks = re.split(r'\n\s*task "', text)[1:]
        for task in tasks:
            blocks = re.findall(r"template \{(.*?)\n\s*\}", task, re.DOTALL)
            holding = [b for b in blocks if "SWITCHBOARD_CLUSTER_TOKEN=" in b]
            assert holding, (path.name, task.split('"', 1)[0])
            # beside the cluster token, in the same env template, read the optional way
            assert all(OPTIONAL_METRICS_TOKEN.search(b) for b in holding), (path.name, task.split('"', 1)[0])
        # never `.metrics_token`: under error_on_missing_key a variable without the key would stop the task
        assert not re.search(r"\{\{[^}]*\.metrics_token", text), path.name
    header = (DEPLOY / "nomad" / "switchboard.nomad.hcl").read_text().split("variable ", 1)[0]
    assert "metrics_token=$(openssl rand -hex 32)" in header
