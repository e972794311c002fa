"""The ``kubernetes`` actuator: the ``scale`` subresource of the shards' Deployment.

Built by ``build_actuator`` (control_plane/scaling/actuators/__init__.py) for ``--actuator kubernetes``;
the autoscaler loop (control_plane/scaling/loop.py) calls it.

    actuator = KubernetesActuator.from_kubeconfig(namespace="switchboard", deployment="switchboard-shard")
    actuator = KubernetesActuator.in_cluster(deployment="switchboard-shard")   # service-account token
    await actuator.current()     # GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale -> spec.replicas
    await actuator.scale_to(3, "waiting above target")
                                 # PATCH the same, application/merge-patch+json {"spec": {"replicas": 3}}

The service account needs ``get`` and ``patch`` on ``deployments/scale`` (see
``deploy/kubernetes/control-plane.yaml``). Kubeconfig support covers a bearer token (``token`` or
``tokenFile``) and client certificates; exec/auth-provider plugins are not run. Kubernetes sends
a removed pod SIGTERM after its ``preStop`` hook; the shard Deployment's hook waits out the
Consul deregistration so the pod leaves routing before it stops admitting.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import yaml

from control_plane.scaling.actuators import ActuatorError

if TYPE_CHECKING:
    from control_plane.settings import ControlPlaneSettings

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service-account token, CA and namespace."""
ENV_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
"""Set by Kubernetes in every pod: the API server's address (with ``KUBERNETES_SERVICE_PORT``)."""
ENV_SERVICE_PORT = "KUBERNETES_SERVICE_PORT"
ENV_KUBECONFIG = "KUBECONFIG"
"""kubectl's variable: the kubeconfig path (first entry of a ``:``-separated list is used)."""
MERGE_PATCH = "application/merge-patch+json"


def default_kubeconfig() -> Path | None:
    """``$KUBECONFIG`` or ``~/.kube/config`` if it exists, else None."""
    env = os.environ.get(ENV_KUBECONFIG)
    path = Path(env.split(os.pathsep)[0]) if env else Path.home() / ".kube" / "config"
    return path if path.is_file() else None


class KubernetesActuator:
    def __init__(
        self,
        *,
        server: str,
        namespace: str,
        deployment: str,
        token: str | None = None,
        verify: ssl.SSLContext | bool = True,
        http: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._url = (
            f"{server.rstrip('/')}/apis/apps/v1/namespaces/{quote(namespace, safe='')}"
            f"/deployments/{quote(deployment, safe='')}/scale"
        )
        self.namespace, self.deployment = namespace, deployment
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owned = http is None
        self._http = http or httpx.AsyncClient(verify=verify, timeout=timeout_s)
        self._timeout_s = timeout_s

    @classmethod
    def in_cluster(cls, *, deployment: str, namespace: str | None = None) -> KubernetesActuator:
        host, port = os.environ.get(ENV_SERVICE_HOST), os.environ.get(ENV_SERVICE_PORT, "443")
        if not host:
            raise ActuatorError(f"not in a Kubernetes pod ({ENV_SERVICE_HOST} unset) and no kubeconfig")
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        ns = namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        verify = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(server=server, namespace=ns, deployment=deployment, token=token, verify=verify)

    @classmethod
    def from_kubeconfig(
        cls,
        path: Path | str | None = None,
        *,
        deployment: str,
        namespace: str | None = None,
        context: str | None = None,
    ) -> KubernetesActuator:
        path = Path(path) if path else default_kubeconfig()
        if path is None:
            raise ActuatorError("no kubeconfig ($KUBECONFIG or ~/.kube/config)")
        server, token, verify, ns = _read_kubeconfig(path, context)
        return cls(
            server=server, namespace=namespace or ns, deployment=deployment, token=token, verify=verify
        )

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings) -> KubernetesActuator:
        if settings.kubeconfig is None and os.environ.get(ENV_SERVICE_HOST):
            return cls.in_cluster(deployment=settings.kube_deployment, namespace=settings.kube_namespace)
        return cls.from_kubeconfig(
            settings.kubeconfig, deployment=settings.kube_deployment, namespace=settings.kube_namespace
        )

    async def current(self) -> int:
        body = await self._call("GET")
        return int((body.get("spec") or {}).get("replicas") or 0)

    async def scale_to(self, n: int, reason: str) -> None:
        # the scale subresource has no place for a reason; the autoscaler's decision log keeps it
        await self._call("PATCH", {"spec": {"replicas": n}})

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def _call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
        try:
            resp = await self._http.request(
                method,
                self._url,
                headers=headers,
                timeout=self._timeout_s,
                content=None if body is None else json.dumps(body).encode(),
            )
        except httpx.HTTPError as exc:
            raise ActuatorError(f"kubernetes at {self._url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise ActuatorError(
                f"kubernetes {method} {self._url} answered {resp.status_code}: "
                f"{_status_message(resp) or resp.text[:300]}"
            )
        try:
            answer = resp.json()
        except ValueError as exc:
            raise ActuatorError(f"kubernetes answered non-JSON: {resp.text[:200]}") from exc
        return answer if isinstance(answer, dict) else {}


def _status_message(resp: httpx.Response) -> str | None:
    """The ``message`` of a Kubernetes ``Status`` error body, if it is one."""
    try:
        body = resp.json()
    except ValueError:
        return None
    return str(body.get("message")) if isinstance(body, dict) and body.get("kind") == "Status" else None


def _read_kubeconfig(path: Path, context: str | None) -> tuple[str, str | None, ssl.SSLContext | bool, str]:
    """(server, token, TLS verification, namespace) of `context` (default: current-context)."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
        name = context or config["current-context"]
        ctx = _named(config, "contexts", name)["context"]
        cluster = _named(config, "clusters", ctx["cluster"])["cluster"]
        user = _named(config, "users", ctx["user"]).get("user") or {}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise ActuatorError(f"cannot read kubeconfig {path}: {type(exc).__name__}: {exc}") from exc
    if "exec" in user or "auth-provider" in user:
        raise ActuatorError(
            f"kubeconfig {path}: user {ctx['user']!r} needs an exec/auth-provider plugin, "
            "which this adapter does not run; use a token or a client certificate"
        )
    try:
        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = Path(user["tokenFile"]).read_text().strip()
        verify = _tls(cluster, user)
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise ActuatorError(f"kubeconfig {path}: bad TLS settings or token file: {exc}") from exc
    return str(cluster["server"]), token, verify, str(ctx.get("namespace") or "default")


def _tls(cluster: dict[str, Any], user: dict[str, Any]) -> ssl.SSLContext | bool:
    if cluster.get("insecure-skip-tls-verify"):
        return False
    verify = ssl.create_default_context()
    if cluster.get("certificate-authority-data"):
        verify.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    elif cluster.get("certificate-authority"):
        verify.load_verify_locations(cafile=cluster["certificate-authority"])
    cert, key = _pem(user, "client-certificate"), _pem(user, "client-key")
    if cert and key:
        verify.load_cert_chain(cert, key)
    return verify


def _named(config: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    for item in config.get(section) or []:
        if isinstance(item, dict) and item.get("name") == name:
            return dict(item)
    raise KeyError(f"{section}/{name}")


def _pem(user: dict[str, Any], key: str) -> str | None:
    """A path to the PEM in `key` (a path) or `key`-data (base64, written to a private temp file)."""
    if user.get(key):
        return str(user[key])
    data = user.get(f"{key}-data")
    if not data:
        return None
    fd, name = tempfile.mkstemp(prefix="switchboard-kube-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data))
    return name
