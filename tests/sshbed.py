"""An sshd inside each host of a :class:`netbed.NetBed`: ssh logins to real namespaces.

Each namespace runs ``/usr/sbin/sshd -D -e`` with a config, host key and
authorized key made for the test in a temp dir, inside a UTS namespace of its
own whose host name is ``sshbed-<i>`` (so a worker started there reports that
name). The client side needs no ``~/.ssh``: :attr:`SshBed.ssh_args` give ``-F
/dev/null``, the test's identity and known-hosts file (host keys pinned,
``StrictHostKeyChecking=yes``).

Everything is removed by :meth:`SshBed.close` (the sshds, then the NetBed).
:func:`unavailable_reason` says why a bed cannot run here (no namespaces, no
sshd), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import netbed
import pytest
from netbed import NetBed
from nsprocs import kill_ns_processes

__all__ = ["SSHD", "SshBed", "ssh_bed", "ssh_bed_session", "unavailable_reason"]

SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> str | None:
    """Why an ssh bed cannot be made here (a skip reason), or None."""
    reason = netbed.unavailable_reason()
    if reason is not None:
        return reason
    if not os.path.exists(SSHD):
        return f"no {SSHD} (install openssh-server; .ci/run does)"
    for tool in ("ssh", "ssh-keygen", "unshare"):
        if shutil.which(tool) is None:
            return f"the ssh test bed needs `{tool}`"
    return None


def _keygen(path: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path],
                   check=True, capture_output=True, timeout=30)


class SshBed:
    """A :class:`NetBed` whose hosts each run an sshd that lets this test's key in.

    Args:
        hosts: how many namespaces.
    """

    def __init__(self, hosts: int = 2) -> None:
        self.net = NetBed(hosts)
        self._tmp = tempfile.TemporaryDirectory(prefix="colobus-sshbed-")
        self.dir = self._tmp.name
        self.identity = os.path.join(self.dir, "id")
        self.known_hosts = os.path.join(self.dir, "known_hosts")
        self._sshds: list[subprocess.Popen[bytes]] = []
        self._closed = False

    @property
    def addresses(self) -> list[str]:
        """Each host's address (what ``ssh`` is given)."""
        return [h.ip for h in self.net.hosts]

    @property
    def controller_ip(self) -> str:
        return self.net.controller_ip

    def hostname(self, i: int) -> str:
        """The host name a process in namespace ``i`` sees."""
        return f"sshbed-{i}"

    def ssh_args(self, identity: str | None = None) -> list[str]:
        """``ssh`` arguments that use only this bed's files (no ``~/.ssh``)."""
        return ["-F", "/dev/null", "-i", identity or self.identity, "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-l", "root"]

    def other_identity(self) -> str:
        """A key pair that the hosts do not accept (a refused login)."""
        path = os.path.join(self.dir, "stranger")
        if not os.path.exists(path):
            _keygen(path)
        return path

    # -- building and tearing down ------------------------------------------------------

    def create(self) -> SshBed:
        try:
            self.net.create()
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        _keygen(self.identity)
        host_key = os.path.join(self.dir, "host_key")
        _keygen(host_key)
        authorized = os.path.join(self.dir, "authorized_keys")
        shutil.copy(self.identity + ".pub", authorized)
        with open(host_key + ".pub") as f:
            host_pub = " ".join(f.read().split()[:2])
        with open(self.known_hosts, "w") as f:
            for ip in self.addresses:
                f.write(f"{ip} {host_pub}\n")
        for h in self.net.hosts:
            config = os.path.join(self.dir, f"sshd_config-{h.index}")
            with open(config, "w") as f:
                f.write("\n".join([
                    f"ListenAddress {h.ip}", "Port 22", f"HostKey {host_key}",
                    f"AuthorizedKeysFile {authorized}", "StrictModes no", "UsePAM no",
                    "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no", "UseDNS no", "PrintMotd no",
                    "PrintLastLog no", f"PidFile {self.dir}/sshd-{h.index}.pid",
                    "LogLevel ERROR", "MaxStartups 50", ""]))
            check = subprocess.run([SSHD, "-t", "-f", config], capture_output=True, text=True,
                                   timeout=30)
            if check.returncode != 0:
                raise RuntimeError(f"sshd refuses the bed's config: {check.stderr.strip()}")
            proc = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c",
                 f'hostname {self.hostname(h.index)} && exec {SSHD} -D -e -f "$0"', config],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._sshds.append(proc)
        for h, proc in zip(self.net.hosts, self._sshds, strict=True):
            self._wait_listening(h.ip, proc)

    def _wait_listening(self, ip: str, proc: subprocess.Popen[bytes], timeout: float = 30.0
                        ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"sshd on {ip} exited ({proc.returncode}): {err.strip()}")
            try:
                with socket.create_connection((ip, 22), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {ip} is not listening after {timeout} s") \
                        from None
                time.sleep(0.05)

    def close(self) -> None:
        """Kill what runs in the bed's namespaces (sshds, sessions, workers), then close
        the NetBed; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            # Whatever still runs in the bed's namespaces (an sshd session, a worker a
            # failed test left) was started through this bed: it goes first.
            for h in self.net.hosts:
                kill_ns_processes(h.ns)
            for p in self._sshds:
                if p.poll() is None:
                    p.kill()
            for p in self._sshds:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
                if p.stderr is not None:
                    p.stderr.close()
        finally:
            self.net.close()
            self._tmp.cleanup()

    def reset(self) -> None:
        """Between tests: every link up again, and nothing but the sshds left running in
        the namespaces (a session or worker a failed test left is killed)."""
        for i in range(len(self.net.hosts)):
            self.net.restore(i)
        sshds = [p.pid for p in self._sshds]
        for h in self.net.hosts:
            kill_ns_processes(h.ns, keep=sshds)

    def __enter__(self) -> SshBed:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using it --------------------------------------------------------------------------

    def ssh(self, i: int, command: Sequence[str], timeout: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on host ``i`` over ssh (a check that logins work)."""
        return subprocess.run(["ssh", *self.ssh_args(), "-o", "BatchMode=yes",
                               self.addresses[i], *command],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)


# -- pytest fixtures (conftest imports them) ------------------------------------------------


@pytest.fixture(scope="session")
def ssh_bed_session() -> Iterator[SshBed]:
    """One 2-host bed for the whole run, made on first use; skips (saying why) where none
    can run here."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SshBed(hosts=2) as b:
        yield b


@pytest.fixture
def ssh_bed(ssh_bed_session: SshBed) -> Iterator[SshBed]:
    """The session's ssh bed for one test, :meth:`SshBed.reset` after it."""
    yield ssh_bed_session
    ssh_bed_session.reset()
