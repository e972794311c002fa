"""The Kubernetes and Nomad specs place a pipelined shard as one group: the flags they add are ones
the shard's own parser accepts, and the resources they ask for are N stages' worth (docs/SHARDING.md)."""

from __future__ import annotations

import re

import yaml

from data_plane.common.settings_cli import parse_settings
from data_plane.shard.settings import ShardSettings
from tests.support.procs import ROOT

DEPLOY = ROOT / "deploy"


def test_kubernetes_overlay_makes_each_replica_a_whole_group() -> None:
    overlay = yaml.safe_load((DEPLOY / "kubernetes" / "pipeline" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../"]
    (patch,) = overlay["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == "switchboard-shard"
    ops = yaml.safe_load(patch["patch"])
    added = [op["value"] for op in ops if op["op"] == "add" and op["path"].endswith("/args/-")]
    base = yaml.safe_load_all((DEPLOY / "kubernetes" / "shards.yaml").read_text())
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
