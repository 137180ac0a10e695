"""Code that travels: the user's own package reaches workers that do not have it.

The workers here are started by hand, as on a remote machine: ``python -m colobus
worker`` in another directory, with no ``PYTHONPATH`` to the user's package. They
live across the tests, so each test's controller is a new session of the same
long-lived workers.
"""

from __future__ import annotations

import asyncio
import glob
import importlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import colobus as cb
from colobus._controller.codeship import Secrets, snapshot, user_package
from colobus._host.shipped import (
    LOCK,
    MAX_ENTRIES,
    MAX_UNPACKED_BYTES,
    PREFIX,
    _in_memory,
    _make_dir,
    _sweep,
    _unpack,
)
from colobus._wire.keys import write_curve_keypair, write_key

HOSTS = 2
FAST = {"heartbeat_interval": 0.2, "liveness_timeout": 5.0, "join_timeout": 90.0}


def _clean_env() -> dict[str, str]:
    """A worker's environment: nothing that points at the driver's code or key."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "COLOBUS_KEY_FILE") and not k.startswith("PYTEST")}
    env["COLOBUS_PARENT_PID"] = str(os.getpid())  # no orphans if this process dies
    env.setdefault("COLOBUS_LOG_LEVEL", "WARNING")
    return env


def start_worker(address: str, key_file: str, name: str, cwd: Path,
                 prelude: str = "") -> subprocess.Popen[str]:
    """``python -m colobus worker`` in ``cwd``; ``prelude`` runs first (test-only fakes)."""
    if prelude:
        argv = [sys.executable, "-c", prelude + "\nfrom colobus._tools.cli import main\n"
                "raise SystemExit(main(sys.argv[1:]))"]
    else:
        argv = [sys.executable, "-m", "colobus"]
    return subprocess.Popen(
        [*argv, "worker", "--connect", address, "--key-file", key_file, "--name", name,
         "--devices", "1"],
        cwd=cwd, env=_clean_env(), stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE if prelude else None, text=True)


class Elsewhere:
    """Workers started by hand in another directory, and the driver's source directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.src = root / "src"
        self.src.mkdir()
        (root / "elsewhere").mkdir()
        self.address = f"ipc://{root}/ctl.sock"
        self.key = b"c" * 32
        self.key_file = str(root / "key")
        Path(self.key_file).write_text(self.key.hex())
        os.chmod(self.key_file, 0o600)
        self.procs = [start_worker(self.address, self.key_file, f"far-{i}", root / "elsewhere")
                      for i in range(HOSTS)]

    def controller(self, **options: Any) -> cb.Controller:
        return cb.Controller(self.address, hosts=HOSTS, key=self.key, **{**FAST, **options})

    def close(self) -> None:
        for p in self.procs:
            p.terminate()  # a worker leaves its session on SIGTERM: its code directory goes
        for p in self.procs:
            try:
                p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate(timeout=10)


@pytest.fixture(scope="module")
def far(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Elsewhere]:
    bed = Elsewhere(tmp_path_factory.mktemp("codeship"))
    sys.path.insert(0, str(bed.src))  # the driver imports its package from its directory
    try:
        yield bed
    finally:
        sys.path.remove(str(bed.src))
        bed.close()


def write_package(src: Path, name: str, scale: int, extra: dict[str, bytes] | None = None
                  ) -> Path:
    """A package with decorated functions, a sibling import and a colocated class."""
    pkg = src / name
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text(f"SCALE = {scale}\n")
    (pkg / "steps.py").write_text(textwrap.dedent("""
        import colobus as cb

        from . import helpers


        @cb.colocated_python
        def step(x):
            return x * helpers.SCALE


        @cb.colocated_python_class
        class Counter:
            def __init__(self, start):
                self.n = start

            def bump(self, x):
                self.n += helpers.SCALE
                return x + self.n
    """))
    for rel, data in (extra or {}).items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(data)
    return pkg


def fresh_import(module: str) -> Any:
    """Import ``module`` anew, as a new run of the driver would."""
    top = module.partition(".")[0]
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    return importlib.import_module(module)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def per_host(ctl: cb.Controller) -> cb.Array:
    mesh = cb.Mesh(np.array(ctl.devices()), ("h",))
    return cb.device_put(np.arange(HOSTS, dtype=np.float32),
                         cb.NamedSharding(mesh, cb.PartitionSpec("h")))


async def fetch(fut: cb.Future[Any]) -> list[float]:
    return list((await cb.device_get(await fut)).tolist())


async def test_the_users_package_travels_and_an_edit_reaches_the_next_session(
        far: Elsewhere) -> None:
    name = unique("mytrain")
    write_package(far.src, name, scale=2)
    steps = fresh_import(f"{name}.steps")
    async with far.controller() as ctl:
        x = per_host(ctl)
        assert await fetch(steps.step(x)) == [0.0, 2.0]  # helpers, a sibling, came along
        counter = steps.Counter(10)
        assert await fetch(counter.bump(x)) == [12.0, 13.0]
        assert await fetch(counter.bump(x)) == [14.0, 15.0]  # one instance per host
        stats = ctl.stats()
        assert stats["code_sent"] == 2 * HOSTS  # a function and a class, once per host
        assert ctl.stats()["packages_sent"] == HOSTS  # the package, once per host
        versions = [h.versions for h in ctl.hosts()]
        assert all(v["python"].split(".")[:2] == [str(n) for n in sys.version_info[:2]]
                   and v["colobus"] == cb.__version__ and v["numpy"] == np.__version__
                   for v in versions), versions
    # The user edits the package and runs the driver again: the same workers run the edit.
    write_package(far.src, name, scale=5)
    steps = fresh_import(f"{name}.steps")
    async with far.controller() as ctl:
        assert await fetch(steps.step(per_host(ctl))) == [0.0, 5.0]
        assert await fetch(steps.Counter(0).bump(per_host(ctl))) == [5.0, 6.0]
        # Each worker holds this session's directory only: the last one went with it.
        base = _in_memory() or tempfile.gettempdir()
        for h in ctl.hosts():
            assert len(glob.glob(os.path.join(base, f"{PREFIX}{h.pid}-*"))) == 1


def test_packages_pip_installed_into_a_folder_on_the_path_stay_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``pip install --target DIR`` + PYTHONPATH (how some machines ship JAX itself): the
    # folder is no site-packages, but its ``*.dist-info`` RECORD says what is installed.
    installed, mine = unique("installed"), unique("mine")
    target = tmp_path / "target"
    for name in (installed, mine):
        (target / name).mkdir(parents=True)
        (target / name / "__init__.py").write_text("X = 1\n")
    info = target / f"{installed}-1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(f"{installed}/__init__.py,sha256=x,6\n"
                                 f"{installed}-1.0.dist-info/RECORD,,\n")
    monkeypatch.syspath_prepend(str(target))
    fresh_import(installed), fresh_import(mine)
    assert user_package(f"{installed}.sub") is None  # installed: never shipped
    assert user_package(mine) == mine  # beside it, without a RECORD: the user's
    sitecustomize = target / "sitecustomize.py"  # each process's own start-up hook
    sitecustomize.write_text("")
    monkeypatch.setitem(sys.modules, "sitecustomize", fresh_import("sitecustomize"))
    assert user_package("sitecustomize") is None


def test_what_dead_workers_left_is_swept(tmp_path: Path) -> None:
    # Judged by each directory's lock, never by a PID: a live session's directory holds
    # its lock; a dead worker's lock went with it; one without a lock file is not ours.
    live, fd = _make_dir(str(tmp_path))
    dead, dead_fd = _make_dir(str(tmp_path))
    os.close(dead_fd)  # its worker is gone: the kernel dropped its lock
    assert (Path(dead) / LOCK).exists()
    unknown = tmp_path / f"{PREFIX}999999999-z"
    (unknown / "pkg").mkdir(parents=True)
    try:
        _sweep(str(tmp_path))
        assert Path(live).exists() and not Path(dead).exists() and unknown.exists()
    finally:
        os.close(fd)


async def test_code_pickled_by_value_takes_the_packages_it_names_along(far: Elsewhere) -> None:
    name = unique("named")
    write_package(far.src, name, scale=9)
    helpers = fresh_import(f"{name}.helpers")

    @cb.colocated_python
    def scaled(x: Any) -> Any:  # defined in a function: by value, naming the user's module
        return x * helpers.SCALE

    async with far.controller() as ctl:
        assert await fetch(scaled(per_host(ctl))) == [0.0, 9.0]
        # the package it names, and this module (its __module__: shipped, never needed)
        assert ctl.stats()["packages_sent"] == 2 * HOSTS


def write_module(src: Path, name: str, scale: int) -> Any:
    """A lone module of the user's with a function, a class and a constant, imported."""
    (src / f"{name}.py").write_text(textwrap.dedent(f"""
        SCALE = {scale}


        def triple(v):
            return v * 3


        class Config:
            def __init__(self, k):
                self.k = k
    """))
    return fresh_import(name)


async def test_modules_named_only_by_arguments_travel(far: Elsewhere) -> None:
    """A call's arguments (a closure over a module, a module's function, an instance of a
    module's class) and a class's constructor arguments name modules nothing else names:
    those travel too, as maxtext's closures given to its ``RemoteIterator`` need."""
    by_call, by_init = write_module(far.src, unique("argmod"), 5), write_module(
        far.src, unique("initmod"), 7)

    @cb.colocated_python
    def use(x: Any, fn: Any, cfg: Any, closure: Any) -> Any:  # names neither module
        return x + fn(1) + cfg.k + closure(1)

    def closure(v: Any) -> Any:
        return v * by_call.SCALE

    @cb.colocated_python_class
    class Holder:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def run(self, x: Any) -> Any:
            return x + self.fn(2)

    async with far.controller() as ctl:
        x = per_host(ctl)
        # 3 (triple) + 4 (Config) + 5 (closure: SCALE) on [0, 1]
        assert await fetch(use(x, by_call.triple, by_call.Config(4), closure)) == [12.0, 13.0]
        holder = Holder(lambda v: v * by_init.SCALE)
        assert await fetch(holder.run(x)) == [14.0, 15.0]
        cb.close(holder)
        assert ctl.stats()["packages_sent"] >= 2 * HOSTS  # both modules, on every host
    # Without shipping, the same call fails on the hosts, naming the module.
    async with far.controller(ship_code=False) as ctl:
        with pytest.raises(ModuleNotFoundError, match=by_call.__name__):
            await asyncio.wait_for(use(per_host(ctl), by_call.triple, 0, closure), 60)


async def test_without_shipping_the_error_names_the_function_and_the_remedy(
        far: Elsewhere) -> None:
    name = unique("noship")
    pkg = write_package(far.src, name, scale=3)
    steps = fresh_import(f"{name}.steps")
    async with far.controller(ship_code=False) as ctl:
        with pytest.raises(ModuleNotFoundError, match=name) as info:
            await asyncio.wait_for(steps.step(per_host(ctl)), 60)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert f"{name}.steps.step cannot be loaded on" in notes, notes
        assert "py_modules=" in notes and "ship_code=True" in notes, notes
        assert "raised on colobus host" in notes, notes
    # py_modules= ships it even so, here as a directory.
    async with far.controller(ship_code=False, py_modules=[pkg]) as ctl:
        assert await fetch(steps.step(per_host(ctl))) == [0.0, 3.0]


async def test_a_dependency_missing_on_the_hosts_is_named_and_is_the_users_to_install(
        far: Elsewhere) -> None:
    """The user's package travels; a package it imports that is installed on the driver
    but not on the hosts is named, as the user's to install there."""
    name, dep = unique("needsdep"), unique("colobus_absent_dependency")
    pkg = far.src / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "steps.py").write_text(textwrap.dedent(f"""
        import os

        import colobus as cb

        if os.getpid() != {os.getpid()}:  # on the hosts only: installed here, not there
            import {dep}


        @cb.colocated_python
        def step(x):
            return x
    """))
    steps = fresh_import(f"{name}.steps")
    async with far.controller() as ctl:
        with pytest.raises(ModuleNotFoundError, match=dep) as info:
            await asyncio.wait_for(steps.step(per_host(ctl)), 60)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"{name}.steps.step cannot be loaded on" in notes, notes
    assert f"it needs the module {dep!r}, which is not installed there" in notes, notes
    assert "Installed dependencies are yours to install on the hosts" in notes, notes
    # the advice to ship code is kept for the user's own modules, and says so
    assert f"If {dep!r} is a module of yours, name it in py_modules=" in notes, notes
    assert "install its package there" not in notes, notes


async def test_modules_registered_by_value_travel_in_the_pickle(far: Elsewhere) -> None:
    name = unique("byvalue")
    (far.src / f"{name}.py").write_text(textwrap.dedent("""
        import colobus as cb

        OFFSET = 7


        @cb.colocated_python
        def shift(x):
            return x + OFFSET
    """))
    module = fresh_import(name)
    cloudpickle.register_pickle_by_value(module)
    try:
        async with far.controller(ship_code=False) as ctl:  # nothing ships but the pickle
            assert await fetch(module.shift(per_host(ctl))) == [7.0, 8.0]
            assert ctl.stats()["packages_sent"] == 0
        async with far.controller() as ctl:  # nor with shipping on: its code is in the pickle
            assert await fetch(module.shift(per_host(ctl))) == [7.0, 8.0]
            assert ctl.stats()["packages_sent"] == 0
    finally:
        cloudpickle.unregister_pickle_by_value(module)


async def test_the_size_limit_names_the_largest_files_and_junk_never_travels(
        far: Elsewhere) -> None:
    junk = {".git/objects/pack": b"g" * 400_000, "__pycache__/steps.cpython.pyc": b"c" * 400_000,
            "venv/pyvenv.cfg": b"home = /usr\n", "venv/lib/big.py": b"#" * 400_000,
            "ext.so": b"\0" * 400_000}
    small = unique("small")
    write_package(far.src, small, scale=4, extra={"data/table.json": b"{}", **junk})
    big = unique("big")
    write_package(far.src, big, scale=6, extra={"data/weights.bin": b"w" * 300_000,
                                                "data/vocab.txt": b"v" * 50_000})
    small_steps, big_steps = fresh_import(f"{small}.steps"), fresh_import(f"{big}.steps")
    shipped = snapshot(small, str(far.src / small))
    assert shipped.nbytes < 10_000
    async with far.controller(max_code_bytes=200_000) as ctl:
        assert await fetch(small_steps.step(per_host(ctl))) == [0.0, 4.0]
        with pytest.raises(cb.SerializationError, match="max_code_bytes=200000") as info:
            await asyncio.wait_for(big_steps.step(per_host(ctl)), 60)
        text = str(info.value)
        assert "weights.bin (0.3 MB)" in text and text.index("weights.bin") < text.index(
            "vocab.txt"), text
        assert await fetch(small_steps.step(per_host(ctl))) == [0.0, 4.0]  # the rest goes on


PROBE = textwrap.dedent("""
    import importlib
    import os

    import numpy as np

    import colobus as cb

    NAMES = {names!r}


    @cb.colocated_python
    def present(x):
        # (the function travels by value: its __file__ would be the driver's path)
        here = os.path.dirname(importlib.import_module(__name__).__file__)
        return np.array([os.path.exists(os.path.join(here, n)) for n in NAMES])
""")


async def test_keys_owner_only_files_and_links_out_never_travel(
        far: Elsewhere, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "colobus.controller")
    name = unique("secrets")
    pkg = write_package(far.src, name, scale=2, extra={"data/ok.txt": b"fine"})
    outside = far.root / f"{name}-credentials"  # e.g. ~/.aws/credentials
    outside.write_text("aws_secret_access_key = x\n")
    outside.chmod(0o644)
    (pkg / "settings.yaml").symlink_to(outside)  # a link out: never followed
    (pkg / "alias.txt").symlink_to(pkg / "data" / "ok.txt")  # a link inside: travels
    (pkg / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (pkg / "id_rsa").chmod(0o600)  # only its owner may read it
    (pkg / "ctl.key").write_text(far.key.hex() + "\n")  # the controller's key, readable
    (pkg / "ctl.key").chmod(0o644)
    write_curve_keypair(pkg / "server.key")  # a CurveZMQ secret (made readable), its public
    (pkg / "server.key").chmod(0o644)
    names = ["settings.yaml", "id_rsa", "ctl.key", "server.key", "server.key.pub", "alias.txt",
             "data/ok.txt"]
    (pkg / "probe.py").write_text(PROBE.format(names=names))
    probe, steps = fresh_import(f"{name}.probe"), fresh_import(f"{name}.steps")
    async with far.controller() as ctl:
        found = (await cb.device_get(await probe.present(per_host(ctl)))).tolist()
        assert dict(zip(names, found, strict=True)) == {
            "settings.yaml": False, "id_rsa": False, "ctl.key": False, "server.key": False,
            "server.key.pub": True, "alias.txt": True, "data/ok.txt": True}
        assert await fetch(steps.step(per_host(ctl))) == [0.0, 2.0]  # the rest works
    said = [r.getMessage() for r in caplog.records if "never travel" in r.getMessage()]
    assert len(said) == 1, said  # once, for the package, whatever the calls
    (line,) = said
    assert f"{name}/settings.yaml: a link to a file outside the package ({outside})" in line
    assert f"{name}/id_rsa: only its owner may read it (mode 600" in line, line
    assert f"{name}/ctl.key: it holds the controller's key" in line, line
    assert f"{name}/server.key: it is a CurveZMQ secret-key file" in line, line
    assert "server.key.pub" not in line and "alias.txt" not in line, line


def test_the_controllers_key_file_stays_home_under_any_name(tmp_path: Path) -> None:
    # The controller's own key file, under another name (a hard link), readable: its
    # identity keeps it home.
    pkg = tmp_path / "keyed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    key_file = tmp_path / "ctl.key"
    write_key(key_file)
    key_file.chmod(0o644)
    os.link(key_file, pkg / "copy.key")
    shipped = snapshot("keyed", str(pkg), secrets=Secrets.of([key_file], []))
    assert shipped.left_out == (("keyed/copy.key", "it is the controller's key file"),)
    assert zipfile.ZipFile(io.BytesIO(shipped.archive)).namelist() == ["keyed/__init__.py"]


def test_bytes_count_as_read_not_as_measured(tmp_path: Path) -> None:
    # A file whose size says 0 but which holds more: a /proc file, bound into the
    # package (what a file that grew after being measured looks like to the limit).
    if os.geteuid() != 0:
        pytest.fail("the /proc case needs root (a mount namespace); CI runs as root")
    pkg = tmp_path / "procfile"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "status.txt").write_text("")
    (pkg / "status.txt").chmod(0o644)
    script = textwrap.dedent(f"""
        import os, sys
        from colobus._controller.codeship import snapshot
        from colobus._errors import SerializationError
        os.system("mount --bind /proc/cpuinfo {pkg}/status.txt")
        assert os.path.getsize("{pkg}/status.txt") == 0  # what it says when measured
        try:
            shipped = snapshot("procfile", "{pkg}", limit=1000)
        except SerializationError as exc:
            print("REFUSED", exc)
        else:
            print("SHIPPED", shipped.nbytes)
    """)
    out = subprocess.run(["unshare", "--mount", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert "max_code_bytes=1000" in out.stdout and "procfile/status.txt" in out.stdout, (
        out.stdout)


WHERE = textwrap.dedent("""
    import importlib

    import numpy as np

    import colobus as cb


    @cb.colocated_python
    def where(x):
        here = importlib.import_module(__name__).__file__
        return np.frombuffer(here.encode(), np.uint8)


    @cb.colocated_python
    def later(x):
        from . import late  # first imported now, from the session's directory

        return x * late.K
""")


def namespaced_worker(address: str, key_file: str, name: str, cwd: Path,
                      before: int) -> subprocess.Popen[bytes]:
    """A worker in a PID namespace of its own, as in a container sharing ``/dev/shm``
    (``--ipc=host``): ``before`` short-lived processes run first there, so its PID in
    that namespace is about ``before + 2``. It dies with its ``unshare``."""
    env = _clean_env()
    del env["COLOBUS_PARENT_PID"]  # its parent there is the namespace's shell
    worker = (f"{sys.executable} -m colobus worker --connect {address} --key-file {key_file} "
              f"--name {name} --devices 1")
    return subprocess.Popen(
        ["unshare", "--pid", "--kill-child", "sh", "-c",
         f"for i in $(seq {before}); do /bin/true; done; {worker}"],
        cwd=cwd, env=env, stdin=subprocess.DEVNULL)


async def test_workers_in_separate_pid_namespaces_sharing_shm_keep_each_others_code(
        far: Elsewhere, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("PID namespaces need root (unshare); CI runs as root")
    name = unique("nsshared")
    pkg = write_package(far.src, name, scale=3)
    (pkg / "probe.py").write_text(WHERE)
    (pkg / "late.py").write_text("K = 4\n")
    probe, steps = fresh_import(f"{name}.probe"), fresh_import(f"{name}.steps")
    key = b"n" * 32
    key_file = tmp_path / "key"
    key_file.write_text(key.hex())
    key_file.chmod(0o600)
    # PIDs about 302 and 12 in their namespaces: each sees the other's as dead (or as
    # another process), so only the directory's lock can tell that it is in use.
    procs = {side: namespaced_worker(f"ipc://{tmp_path}/{side}.sock", str(key_file),
                                     f"ns-{side}", tmp_path, before)
             for side, before in (("a", 300), ("b", 10))}
    try:
        async with cb.Controller(f"ipc://{tmp_path}/a.sock", hosts=1, key=key,
                                 **FAST) as a:
            one = cb.device_put(np.ones(1, np.float32), cb.SingleDeviceSharding(a.devices()[0]))
            here = bytes((await cb.device_get(await probe.where(one))).tolist()).decode()
            directory = os.path.dirname(os.path.dirname(here))  # the session's directory
            assert os.path.basename(directory).startswith(PREFIX), directory
            async with cb.Controller(f"ipc://{tmp_path}/b.sock", hosts=1, key=key,
                                     **FAST) as b:  # another session, in another namespace
                other = cb.device_put(np.ones(1, np.float32),
                                      cb.SingleDeviceSharding(b.devices()[0]))
                assert await fetch(steps.step(other)) == [3.0]  # unpacked: b swept first
                assert os.path.isdir(directory) and os.path.isfile(here)
            # a's session goes on: a module it never imported is still there to import
            assert await fetch(probe.later(one)) == [4.0]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=30)


FAKE = """import sys
import colobus._wire.versions as v
real = v.local_versions
v.local_versions = lambda: {{**real(), {fake}}}  # test only: what this worker claims
"""


async def test_versions_are_checked_at_the_door(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "colobus.controller")
    address, key = f"ipc://{tmp_path}/door.sock", b"d" * 32
    key_file = tmp_path / "key"
    key_file.write_text(key.hex())
    key_file.chmod(0o600)
    procs = [start_worker(address, str(key_file), name, tmp_path, FAKE.format(fake=fake))
             for name, fake in (("old", '"python": "3.9.18", "colobus": "0.0.1"'),
                                ("other-jax", '"jax": "0.0.1"'))]
    try:
        async with cb.Controller(address, hosts=1, key=key, **FAST) as ctl:
            _, err = await asyncio.to_thread(procs[0].communicate, timeout=60)
            assert procs[0].returncode not in (0, None)  # it exits, saying why in one line
            (line,) = [ln for ln in err.splitlines() if "refused" in ln]
            python = ".".join(map(str, sys.version_info[:3]))
            assert f"python 3.9.18 on the host, {python} on the controller" in line, err
            assert f"colobus 0.0.1 on the host, {cb.__version__} on the controller" in line, err
            (host,) = ctl.hosts()
            assert host.name == "other-jax" and host.versions["jax"] == "0.0.1"
            warned = [r.getMessage() for r in caplog.records]
            assert any("'other-jax'" in w and "jax 0.0.1 on the host" in w for w in warned)
            assert any("'old'" in w and "refused" in w for w in warned), warned
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=10)


async def test_what_a_host_reports_at_join_is_bounded_strings_only() -> None:
    """Versions are compared and shown, never imported: a non-string is malformed, and a
    raw peer claiming another Python gets the refusal."""
    import secrets

    import zmq
    import zmq.asyncio

    from colobus._wire import protocol as P
    from colobus._wire.envelope import Envelope, decode, encode

    key = secrets.token_bytes(32)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    session, seq = secrets.token_bytes(16), 0

    async def ask(body: P.Body) -> Envelope:
        nonlocal seq
        seq += 1
        await sock.send_multipart(encode(key, Envelope(body.kind, session, b"", seq,
                                                       body.to_wire())))
        return decode(key, await asyncio.wait_for(sock.recv_multipart(), 10))

    try:
        async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, relays=0) as ctl:
            sock.connect(ctl.address)
            for versions, what in (({"python": 3}, "malformed"),
                                   ({"python": "2.7.18", "numpy": "os.system"}, "reject")):
                nonce = bytes((await ask(P.Join())).body[0])
                hello = P.Hello("raw", 1, "raw", [], nonce, "", versions)  # type: ignore[arg-type]
                if what == "malformed":
                    seq += 1
                    await sock.send_multipart(encode(key, Envelope(
                        hello.kind, session, b"", seq, hello.to_wire())))
                    deadline = asyncio.get_running_loop().time() + 10
                    while ctl.stats()["dropped"].get("malformed", 0) < 1:
                        assert asyncio.get_running_loop().time() < deadline
                        await asyncio.sleep(0.02)
                    continue
                reply = await ask(hello)
                assert reply.kind == P.Kind.REJECT
                assert "python 2.7.18 on the host" in reply.body[0], reply.body
            assert ctl.hosts() == []
    finally:
        sock.close(0)
        ctx.term()


def _zip(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for rel, data in files.items():
            z.writestr(rel, data)
    return out.getvalue()


def test_unpacking_checks_entries_and_size_before_writing(tmp_path: Path) -> None:
    archive = _zip({"pkg/__init__.py": b"", "pkg/a.py": b"A = 1\n"})
    with pytest.raises(ValueError, match=f"bound of {MAX_ENTRIES} files per session"):
        _unpack("pkg", archive, str(tmp_path), entries=MAX_ENTRIES - 1)
    with pytest.raises(ValueError, match=f"bound of {MAX_UNPACKED_BYTES} bytes per session"):
        _unpack("pkg", archive, str(tmp_path), nbytes=MAX_UNPACKED_BYTES - 3)
    # What the archive says its files unpack to (3.75 GiB each here) is checked before
    # anything is written: a zip bomb writes nothing.
    raw = bytearray(archive)
    at = 0
    while (at := raw.find(b"PK\x01\x02", at)) >= 0:  # each central directory entry
        raw[at + 24:at + 28] = (0xF0000000).to_bytes(4, "little")  # its unpacked size
        at += 4
    with pytest.raises(ValueError, match="unpacks to 8053063680 bytes"):
        _unpack("pkg", bytes(raw), str(tmp_path))
    assert os.listdir(tmp_path) == []
    assert _unpack("pkg", archive, str(tmp_path)) == (2, 6)  # within the bounds: there
    assert (tmp_path / "pkg" / "a.py").read_bytes() == b"A = 1\n"


# The disk of the worker is full (test only): every unpacking fails, as ENOSPC would.
FULL = """import sys, zipfile
def _full(*args, **kwargs):
    raise OSError(28, "No space left on device")
zipfile.ZipFile.extractall = _full
"""


async def test_a_package_that_does_not_unpack_fails_its_calls_with_the_reason(
        far: Elsewhere, tmp_path: Path) -> None:
    # The worker's own directory holds an old copy of the package (on its sys.path): the
    # call must not quietly run it when the shipped one did not unpack.
    name = unique("unpack")
    write_package(far.src, name, scale=2)
    steps = fresh_import(f"{name}.steps")
    write_package(tmp_path, name, scale=100)  # the decoy, in the worker's directory
    key = b"u" * 32
    key_file = tmp_path / "key"
    key_file.write_text(key.hex())
    key_file.chmod(0o600)
    address = f"ipc://{tmp_path}/unpack.sock"
    proc = start_worker(address, str(key_file), "full-disk", tmp_path, FULL)
    try:
        async with cb.Controller(address, hosts=1, key=key, **FAST) as ctl:
            x = cb.device_put(np.ones(1, np.float32), cb.SingleDeviceSharding(ctl.devices()[0]))
            for _ in range(2):  # every call that needs it, not only the first
                with pytest.raises(ImportError) as info:
                    await asyncio.wait_for(steps.step(x), 60)
                text = str(info.value)
                assert f"package {name!r}, which the controller shipped, did not unpack on " \
                    "this host" in text, text
                assert "No space left on device" in text, text
    finally:
        proc.kill()
        proc.communicate(timeout=30)


async def _raw_peer(ctl: cb.Controller) -> tuple[Any, Any]:
    """A socket that speaks the protocol by hand, and ``hello(versions, hostname)``: a
    JOIN, then a HELLO with those, answered by the controller's reply."""
    import secrets

    import zmq
    import zmq.asyncio

    from colobus._wire import protocol as P
    from colobus._wire.envelope import Envelope, decode, encode

    key = ctl._key
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctl.address)
    session, seq = secrets.token_bytes(16), 0

    async def ask(body: P.Body) -> Envelope:
        nonlocal seq
        seq += 1
        await sock.send_multipart(encode(key, Envelope(body.kind, session, b"", seq,
                                                       body.to_wire())))
        return decode(key, await asyncio.wait_for(sock.recv_multipart(), 10))

    async def hello(versions: dict[str, str], hostname: str = "raw") -> Envelope:
        nonce = bytes((await ask(P.Join())).body[0])
        return await ask(P.Hello("raw", 1, hostname, [], nonce, "", versions))

    def close() -> None:
        sock.close(0)
        ctx.term()

    return hello, close


async def test_a_worker_without_versions_is_refused_and_refusals_are_quoted_and_few(
        caplog: pytest.LogCaptureFixture) -> None:
    from colobus._wire import protocol as P
    from colobus._wire.versions import local_versions

    caplog.set_level(logging.INFO, "colobus.controller")
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=b"q" * 32, relays=0) as ctl:
        hello, close = await _raw_peer(ctl)
        try:
            for versions in ({}, {"numpy": np.__version__}):  # no Python, no colobus
                reply = await hello(versions)
                assert reply.kind == P.Kind.REJECT, reply
                assert "the host reported no python or colobus version" in reply.body[0]
            # What a worker sends cannot forge log lines: line breaks, escape codes.
            forged = "3.9\n2099-01-01 WARNING colobus.controller: all is well\x1b[2J"
            for _ in range(20):
                reply = await hello({**local_versions(), "python": forged},
                                    hostname="evil\nhost\x1b[31m")
                assert reply.kind == P.Kind.REJECT, reply
            assert ctl.hosts() == []
            lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            assert len(lines) == 1, lines  # 22 refusals, one line (then one a minute)
            ctl._sessions.refusals.flush(time.monotonic() + 3600)  # the next summary
            lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            assert len(lines) == 2 and "21 more joins refused" in lines[1], lines
            assert repr(forged) in lines[1] and repr("evil\nhost\x1b[31m") in lines[1], lines
            for record in caplog.records:
                assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()
        finally:
            close()
