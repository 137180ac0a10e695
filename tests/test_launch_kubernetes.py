"""``colobus manifest kubernetes``: the manifests validate against Kubernetes' own schemas
(``kubernetes-validate``, strict, offline: it ships them) for several option sets, and
never hold a key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml
from nsprocs import run_cli

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")

OPTION_SETS = [
    ["--workers", "1", "--image", "colobus:latest"],
    ["--workers", "4", "--image", "ghcr.io/acme/colobus:0.1", "--devices", "8",
     "--namespace", "ml-team", "--port", "6000"],
    ["--workers", "16", "--image", "registry.local:5000/colobus@sha256:" + "a" * 64,
     "--gpus-per-worker", "8", "--devices", "2"],
    ["--workers", "2", "--image", "colobus", "--namespace", "default",
     "--gpus-per-worker", "1"],
]


def manifest_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``colobus manifest kubernetes ARGS`` as a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "COLOBUS_KEY_FILE"}
    return subprocess.run([sys.executable, "-m", "colobus", "manifest", "kubernetes", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def manifest(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The same through the command's entry point in this process (the strictness test
    below runs the real process too)."""
    return run_cli(["manifest", "kubernetes", *args])


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("args", OPTION_SETS, ids=lambda a: " ".join(a[:4]))
def test_manifests_validate_strictly_and_say_what_was_asked(args: list[str]) -> None:
    out = manifest(args)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    assert [d["kind"] for d in docs] == ["Service", "Service", "StatefulSet"]
    for d in docs:
        validate(d)
    driver, _, workers = docs
    namespace = option(args, "--namespace")
    port = int(option(args, "--port") or 5555)
    for d in docs:
        assert d["metadata"].get("namespace") == namespace
    assert driver["spec"]["clusterIP"] == "None"  # headless
    assert driver["spec"]["ports"][0]["port"] == port
    assert workers["spec"]["replicas"] == int(option(args, "--workers") or 0)
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    assert container["image"] == option(args, "--image")
    cmd = container["command"]
    assert cmd[:4] == ["colobus", "worker", "--connect", f"tcp://colobus-driver:{port}"]
    assert cmd[cmd.index("--name") + 1] == "$(POD_NAME)"  # a name per pod
    assert cmd[cmd.index("--devices") + 1] == (option(args, "--devices") or "1")
    key_file = cmd[cmd.index("--key-file") + 1]
    (mount,) = container["volumeMounts"]
    assert key_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    (volume,) = workers["spec"]["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "colobus-key"
    gpus = option(args, "--gpus-per-worker")
    if gpus is None:
        assert "resources" not in container
    else:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(gpus)
    # The Secret is referenced and how to make it is said; no key and no Secret object.
    assert "kubectl create secret generic colobus-key" in out.stdout
    assert "--from-file=key=" in out.stdout
    assert all(d["kind"] != "Secret" for d in docs)
    assert not re.search(r"^\s*(data|stringData):", out.stdout, re.M)


def test_the_validator_is_strict_about_what_we_print() -> None:
    """The check above can fail: an unknown field, or a GPU count as a list, is refused."""
    out = manifest_process(OPTION_SETS[0])
    assert out.returncode == 0, out.stderr
    assert out.stdout == manifest(OPTION_SETS[0]).stdout  # the process prints the same
    docs = list(yaml.safe_load_all(out.stdout))
    docs[2]["spec"]["template"]["spec"]["containers"][0]["gpu"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(docs[2])
    docs[0]["spec"]["ports"][0]["port"] = "not a port"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(docs[0])


@pytest.mark.parametrize(("args", "says"), [
    (["--workers", "2", "--image", "x", "--namespace", "Bad_NS"], "not a Kubernetes namespace"),
    (["--workers", "0", "--image", "x"], "must be 1 or more"),
    (["--workers", "2", "--image", "x", "--port", "70000"], "not a port number"),
    (["--workers", "2"], "--image"),
])
def test_bad_options_are_one_line_errors(args: list[str], says: str) -> None:
    out = manifest(args)
    assert out.returncode == 2
    assert says in out.stderr and "Traceback" not in out.stderr
