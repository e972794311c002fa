"""The part of `kustomize build` that deploy/kubernetes uses, in Python, so the specs can be checked
where kubectl is not installed (CI): resources (files and directories), namespace, labels without
selectors, images, configMapGenerator (files; no hash suffix, so names stay as written), and patches
(RFC 6902 lists with a target, strategic-merge `$patch: delete`). Anything else in a kustomization
raises, so a spec that starts using more of kustomize fails here instead of being checked half-built.
tests/control_plane/test_pipeline_specs.py compares it with kubectl's own kustomize where kubectl is."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

Obj = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "configMapGenerator", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}


def build(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize directory` prints (modulo generated names' hash suffixes)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization fields this builder does not know: {sorted(unknown)}")
    objs: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objs += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in spec.get("configMapGenerator", []):
        if set(gen) - {"name", "files"}:
            raise NotImplementedError(f"{directory}: configMapGenerator fields {sorted(gen)}")
        data = {Path(f).name: (directory / f).read_text() for f in gen.get("files", [])}
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in spec.get("patches", []):
        objs = _patched(objs, patch)
    for image in spec.get("images", []):
        for obj in objs:
            for c in _containers(obj):
                if c.get("image", "").split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for label in spec.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates"):
            raise NotImplementedError(f"{directory}: labels reaching selectors or templates")
        for obj in objs:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    if "namespace" in spec:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
            for subject in obj.get("subjects", []) if obj["kind"] in ("RoleBinding", "ClusterRoleBinding") else []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = spec["namespace"]
    return objs


def _patched(objs: list[Obj], patch: Obj) -> list[Obj]:
    body = yaml.safe_load(patch["patch"])
    if isinstance(body, dict):  # strategic merge: only deletion is used
        if body.get("$patch") != "delete":
            raise NotImplementedError(f"strategic-merge patch other than $patch: delete: {body}")
        gone = (body["kind"], body["metadata"]["name"])
        kept = [o for o in objs if (o["kind"], o["metadata"]["name"]) != gone]
        if len(kept) == len(objs):
            raise LookupError(f"$patch: delete names no object: {gone}")
        return kept
    target = patch["target"]
    hits = [o for o in objs if _matches(o, target)]
    if not hits:
        raise LookupError(f"patch target matches nothing: {target}")
    out = []
    for o in objs:
        out.append(jsonpatch.apply_patch(copy.deepcopy(o), body) if _matches(o, target) else o)
    return out


def _matches(obj: Obj, target: Obj) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return (target.get("kind", obj["kind"]) == obj["kind"]
            and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
            and target.get("group", group) == group and target.get("version", version) == version)


def _containers(obj: Obj) -> list[Obj]:
    pod = pod_spec(obj)
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])] if pod else []


def pod_spec(obj: Obj) -> Obj | None:
    """The pod spec of a workload (Deployment, StatefulSet, DaemonSet, Job), None for anything else."""
    template = (obj.get("spec") or {}).get("template")
    return template.get("spec") if isinstance(template, dict) else None
