"""``colobus manifest kubernetes``: manifests for a colobus cluster on Kubernetes.

What it prints (YAML, one document each):

- a headless Service ``colobus-driver`` in front of the driver pod (the pod
  labelled ``app.kubernetes.io/component: driver``), on ``--port``;
- a headless Service ``colobus-workers`` that governs the StatefulSet;
- the workers: a StatefulSet of ``--workers`` pods, each running ``colobus
  worker --connect tcp://colobus-driver:PORT --name $(POD_NAME) --key-file
  /etc/colobus/key``: a name per pod, so a pod that Kubernetes restarts rejoins
  as the same host. ``--gpus-per-worker G`` requests ``nvidia.com/gpu: G``.

The key comes from the Secret ``colobus-key`` (mounted read-only, mode 0400);
the manifests only reference it, and the comment at the top says how to make
it with ``kubectl create secret generic ... --from-file=key=...``. No key is
ever written into them.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

__all__ = ["KEY_DIR", "SECRET_NAME", "add_manifest_parser", "kubernetes_manifests",
           "render_manifests", "run_manifest", "to_yaml"]

SECRET_NAME = "colobus-key"
KEY_DIR = "/etc/colobus"
DRIVER_SERVICE = "colobus-driver"
WORKER_SERVICE = "colobus-workers"
WORKER_SET = "colobus-worker"
APP = "colobus"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def kubernetes_manifests(*, workers: int, image: str, devices: int = 1,
                         namespace: str | None = None, gpus_per_worker: int | None = None,
                         port: int = 5555) -> list[dict[str, Any]]:
    """The objects of a colobus cluster: two headless Services and the worker StatefulSet.

    Raises:
        ValueError: a count below 1, a port out of range, or a namespace that is
            not a DNS label.
    """
    if workers < 1 or devices < 1 or (gpus_per_worker is not None and gpus_per_worker < 1):
        raise ValueError("--workers, --devices and --gpus-per-worker must be 1 or more")
    if not 0 < port < 65536:
        raise ValueError(f"--port {port} is not a port number (1 to 65535)")
    if namespace is not None and not _DNS_LABEL.match(namespace):
        raise ValueError(f"--namespace {namespace!r} is not a Kubernetes namespace name "
                         "(lower-case letters, digits and '-')")
    if not image.strip():
        raise ValueError("--image is empty")

    def meta(name: str, component: str) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name}
        if namespace is not None:
            m["namespace"] = namespace
        m["labels"] = _labels(component)
        return m

    driver_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(DRIVER_SERVICE, "driver"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # workers may connect before it is Ready
            "selector": _labels("driver"),
            "ports": [{"name": "colobus", "port": port, "targetPort": port,
                       "protocol": "TCP"}],
        },
    }
    worker_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(WORKER_SERVICE, "worker"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _labels("worker"),
                 "ports": [{"name": "none", "port": 9, "protocol": "TCP"}]},
    }
    container: dict[str, Any] = {
        "name": "worker",
        "image": image,
        "command": ["colobus", "worker", "--connect", f"tcp://{DRIVER_SERVICE}:{port}",
                    "--devices", str(devices), "--name", "$(POD_NAME)",
                    "--key-file", f"{KEY_DIR}/key"],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "volumeMounts": [{"name": "colobus-key", "mountPath": KEY_DIR, "readOnly": True}],
    }
    if gpus_per_worker is not None:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_worker}}
    workers_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(WORKER_SET, "worker"),
        "spec": {
            "serviceName": WORKER_SERVICE,
            "replicas": workers,
            "podManagementPolicy": "Parallel",  # all at once, not one after another
            "selector": {"matchLabels": _labels("worker")},
            "template": {
                "metadata": {"labels": _labels("worker")},
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [container],
                    "volumes": [{"name": "colobus-key",
                                 "secret": {"secretName": SECRET_NAME, "defaultMode": 0o400}}],
                },
            },
        },
    }
    return [driver_service, worker_service, workers_set]


def render_manifests(objects: list[dict[str, Any]], *, workers: int, port: int,
                     namespace: str | None = None) -> str:
    """The objects as YAML documents, after a comment on the Secret and the driver."""
    ns = f" -n {namespace}" if namespace else ""
    head = "\n".join([
        f"# colobus: {workers} worker(s) for a driver behind the Service {DRIVER_SERVICE}.",
        "# The key is a Secret made beforehand; it is never written into these manifests:",
        "#   colobus keygen colobus.key",
        f"#   kubectl create secret generic {SECRET_NAME}{ns} --from-file=key=colobus.key",
        "# The driver: a pod labelled app.kubernetes.io/name=colobus,",
        "# app.kubernetes.io/component=driver, with that Secret mounted at "
        f"{KEY_DIR} and the environment",
        f"#   COLOBUS_ADDRESS=tcp://0.0.0.0:{port}  COLOBUS_KEY_FILE={KEY_DIR}/key  "
        f"COLOBUS_HOSTS={workers}",
        "# so that cb.Controller() (or cb.init()) in it binds there and waits for the workers.",
    ])
    return head + "\n" + "".join("---\n" + to_yaml(o) for o in objects)


_PLAIN_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9._/-]*$")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def _key(key: str) -> str:
    """A mapping key, bare where YAML reads it back as the same string."""
    return key if _PLAIN_KEY.match(key) and key.lower() not in _YAML_WORDS else _scalar(key)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a YAML double-quoted scalar


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists, strings, ints and bools (no dependency).

    Every string is double-quoted, so none is read back as a number, a bool or null.
    """
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}{_key(k)}:")
                lines.append(to_yaml(v, indent + 2).rstrip("\n"))
            else:
                lines.append(f"{pad}{_key(k)}: {_empty(v)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = to_yaml(item, indent + 2)
                lines.append(f"{pad}- {inner[indent + 2:].rstrip(chr(10))}")
            else:
                lines.append(f"{pad}- {_empty(item)}")
    else:
        lines.append(pad + _scalar(value))
    return "\n".join(lines) + "\n"


def _empty(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def add_manifest_parser(sub: Any, positive_int: Any) -> None:
    """Add ``colobus manifest kubernetes`` to the ``colobus`` subcommands."""
    m = sub.add_parser("manifest", help="print deployment manifests for a cluster")
    kinds = m.add_subparsers(dest="kind", metavar="KIND", required=True,
                             parser_class=type(m), help="the kind of cluster")
    k = kinds.add_parser("kubernetes", help="a headless Service for the driver and the "
                                            "workers as a StatefulSet (YAML on stdout)")
    k.add_argument("--workers", type=positive_int, required=True, help="worker pods (hosts)")
    k.add_argument("--image", required=True, help="a container image with colobus installed")
    k.add_argument("--devices", type=positive_int, default=1,
                   help="CPU devices per worker (default 1)")
    k.add_argument("--namespace", default=None, help="the namespace (default: kubectl's)")
    k.add_argument("--gpus-per-worker", type=positive_int, default=None, metavar="G",
                   help="request G nvidia.com/gpu per worker pod")
    k.add_argument("--port", type=positive_int, default=5555,
                   help="the driver's port (default 5555)")


def run_manifest(args: argparse.Namespace) -> str:
    """The text ``colobus manifest kubernetes`` prints.

    Raises:
        ValueError: an option out of range (the message names it).
    """
    objects = kubernetes_manifests(workers=args.workers, image=args.image, devices=args.devices,
                                   namespace=args.namespace,
                                   gpus_per_worker=args.gpus_per_worker, port=args.port)
    return render_manifests(objects, workers=args.workers, port=args.port,
                            namespace=args.namespace)
