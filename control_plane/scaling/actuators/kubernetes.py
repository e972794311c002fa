"""The ``kubernetes`` actuator: the ``scale`` subresource of the shards' Deployment; and
:class:`KubeClient`, its connection to the API server, which the pipeline-group variant
(:mod:`.kubernetes_groups`, built instead with ``--pipeline-group-template``) shares.

Built by ``build_actuator`` (control_plane/scaling/actuators/__init__.py) for ``--actuator kubernetes``;
the autoscaler loop (control_plane/scaling/loop.py) calls it.

    actuator = KubernetesActuator.from_kubeconfig(namespace="switchboard", deployment="switchboard-shard")
    actuator = KubernetesActuator.in_cluster(deployment="switchboard-shard")   # service-account token
    await actuator.current()     # GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale -> spec.replicas
    await actuator.scale_to(3, "waiting above target")
                                 # PATCH the same, application/merge-patch+json {"spec": {"replicas": 3}}

The service account needs ``get`` and ``patch`` on ``deployments/scale`` (see
``deploy/kubernetes/base/control-plane.yaml``). Kubeconfig support covers a bearer token (``token`` or
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


class KubeClient:
    """The API server, as these actuators talk to it: bearer token, TLS, ``Status`` errors mapped to
    :class:`ActuatorError`. Built from the pod's service account or a kubeconfig (:meth:`connect`)."""

    def __init__(
        self,
        server: str,
        *,
        namespace: str,
        token: str | None = None,
        verify: ssl.SSLContext | bool = True,
        http: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.server, self.namespace = server.rstrip("/"), namespace
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owned = http is None
        self._http = http or httpx.AsyncClient(verify=verify, timeout=timeout_s)
        self._timeout_s = timeout_s

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> KubeClient:
        host, port = os.environ.get(ENV_SERVICE_HOST), os.environ.get(ENV_SERVICE_PORT, "443")
        if not host:
            raise ActuatorError(f"not in a Kubernetes pod ({ENV_SERVICE_HOST} unset) and no kubeconfig")
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        ns = namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        verify = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(server, namespace=ns, token=token, verify=verify)

    @classmethod
    def from_kubeconfig(
        cls, path: Path | str | None = None, *, namespace: str | None = None, context: str | None = None
    ) -> KubeClient:
        path = Path(path) if path else default_kubeconfig()
        if path is None:
            raise ActuatorError("no kubeconfig ($KUBECONFIG or ~/.kube/config)")
        server, token, verify, ns = _read_kubeconfig(path, context)
        return cls(server, namespace=namespace or ns, token=token, verify=verify)

    @classmethod
    def connect(cls, settings: ControlPlaneSettings) -> KubeClient:
        """In a pod without ``--kubeconfig``: the service account; else the kubeconfig."""
        if settings.kubeconfig is None and os.environ.get(ENV_SERVICE_HOST):
            return cls.in_cluster(settings.kube_namespace)
        return cls.from_kubeconfig(settings.kubeconfig, namespace=settings.kube_namespace)

    def path(self, api: str, resource: str, name: str | None = None) -> str:
        """``/apis/apps/v1/namespaces/NS/statefulsets[/NAME]`` (`api` ``apis/apps/v1`` or ``api/v1``)."""
        tail = f"/{quote(name, safe='')}" if name else ""
        return f"/{api}/namespaces/{quote(self.namespace, safe='')}/{resource}{tail}"

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of an answer whose status is in `ok`; anything else is an ActuatorError."""
        url = self.server + path
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            resp = await self._http.request(
                method,
                url,
                headers=headers,
                params=params,
                timeout=self._timeout_s,
                content=None if body is None else json.dumps(body).encode(),
            )
        except httpx.HTTPError as exc:
            raise ActuatorError(f"kubernetes at {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code not in ok:
            raise ActuatorError(
                f"kubernetes {method} {url} answered {resp.status_code}: "
                f"{_status_message(resp) or resp.text[:300]}"
            )
        try:
            answer = resp.json()
        except ValueError as exc:
            raise ActuatorError(f"kubernetes answered non-JSON: {resp.text[:200]}") from exc
        return resp.status_code, answer if isinstance(answer, dict) else {}

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()


class KubernetesActuator:
    def __init__(self, api: KubeClient, *, deployment: str) -> None:
        self.namespace, self.deployment = api.namespace, deployment
        self._api = api
        self._path = api.path("apis/apps/v1", "deployments", deployment) + "/scale"

    @classmethod
    def in_cluster(cls, *, deployment: str, namespace: str | None = None) -> KubernetesActuator:
        return cls(KubeClient.in_cluster(namespace), deployment=deployment)

    @classmethod
    def from_kubeconfig(
        cls,
        path: Path | str | None = None,
        *,
        deployment: str,
        namespace: str | None = None,
        context: str | None = None,
    ) -> KubernetesActuator:
        return cls(KubeClient.from_kubeconfig(path, namespace=namespace, context=context), deployment=deployment)

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings) -> KubernetesActuator:
        return cls(KubeClient.connect(settings), deployment=settings.kube_deployment)

    async def current(self) -> int:
        _, body = await self._api.request("GET", self._path)
        return int((body.get("spec") or {}).get("replicas") or 0)

    async def scale_to(self, n: int, reason: str) -> None:
        # the scale subresource has no place for a reason; the autoscaler's decision log keeps it
        await self._api.request("PATCH", self._path, {"spec": {"replicas": n}}, content_type=MERGE_PATCH)

    async def aclose(self) -> None:
        await self._api.aclose()


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
