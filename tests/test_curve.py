"""Optional CurveZMQ encryption: key pairs, the allow-list, and workers that must not join."""

from __future__ import annotations

import os
import pathlib
import secrets
import stat
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth

import colobus as cb


@cb.colocated_python
def triple(x: Any) -> Any:
    return x * 3


def _keygen(path: pathlib.Path) -> None:
    out = subprocess.run([sys.executable, "-m", "colobus", "keygen", "--curve", str(path)],
                         check=True, capture_output=True, text=True)
    assert "CurveZMQ" in out.stdout


def _worker(address: str, key: bytes, name: str, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "colobus", "worker", "--connect", address, "--devices", "1",
         "--name", name, "--key-file", "-", *extra],
        stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)})
    assert proc.stdin is not None
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    return proc


def test_keygen_curve_writes_a_private_secret_and_a_public_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "server.key"
    _keygen(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pub = tmp_path / "server.key.pub"
    public, secret = zmq.auth.load_certificate(path)
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(pub) == (public, None)
    assert b"secret-key" not in pub.read_bytes()


def test_curve_allowed_worker_joins_others_never_do(tmp_path: pathlib.Path) -> None:
    for name in ("server", "good", "stranger"):
        _keygen(tmp_path / f"{name}.key")
    key = secrets.token_bytes(32)
    server_pub = str(tmp_path / "server.key.pub")
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key,
                        curve_secret_key=str(tmp_path / "server.key"),
                        curve_allow=[tmp_path / "good.key.pub"])
    procs: list[subprocess.Popen[bytes]] = []
    with ctl:
        addr = ctl.address
        procs.append(_worker(addr, key, "good", "--curve-key-file",
                             str(tmp_path / "good.key"), "--server-key", server_pub))
        # A key pair not on the allow-list; no encryption at all; the allowed key
        # pair but a wrong idea of the server's key.
        procs.append(_worker(addr, key, "stranger", "--curve-key-file",
                             str(tmp_path / "stranger.key"), "--server-key", server_pub))
        procs.append(_worker(addr, key, "plain"))
        procs.append(_worker(addr, key, "wrong-server", "--curve-key-file",
                             str(tmp_path / "good.key"), "--server-key",
                             str(tmp_path / "stranger.key.pub")))
        try:
            ctl.run_sync(ctl.wait_for_hosts(1, timeout=90))
            assert [h.name for h in ctl.hosts()] == ["good"]
            x = cb.device_put(np.arange(3), cb.devices()[0])
            assert np.asarray(triple(x)).tolist() == [0, 3, 6]
            # The others started with the good one and keep trying: still out.
            time.sleep(3)
            assert [h.name for h in ctl.hosts()] == ["good"]
            assert all(p.poll() is None for p in procs[1:]), "a refused worker crashed"
            assert ctl.stats()["dropped_total"] == 0  # refused before any message got in
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()


def test_curve_options_are_checked(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="curve_secret_key"):
        cb.Controller("tcp://127.0.0.1:*", curve_allow=[])
    with pytest.raises(cb.AuthenticationError):
        cb.Controller("tcp://127.0.0.1:*", curve_secret_key="not a key")
    _keygen(tmp_path / "s.key")
    with pytest.raises(cb.AuthenticationError, match="only a public key"):
        cb.Controller("tcp://127.0.0.1:*", curve_secret_key=tmp_path / "s.key.pub")
    with pytest.raises(ValueError, match="CurveZMQ"):
        cb.local_cluster(hosts=1, curve_secret_key=tmp_path / "s.key")
