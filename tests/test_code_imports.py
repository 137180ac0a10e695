"""Modules host code imports travel when the host imports them (SPEC 11).

A driver in one directory uses modules of the user's from another (a checkout on its
``PYTHONPATH``) that it never imports itself: host code imports them inside a function
(``import helpers``) or by name (``importlib.import_module``). The worker, started by
hand in an empty directory with nothing of the user's, lacks them; it asks the
controller, which sends the package as it ships any, and the import succeeds. What
never travels still does not; a module that is nowhere, or installed on the controller
only, fails with an error that says which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colobus._wire.keys import write_key

DRIVER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def use_helpers(x):
        import helpers  # only here: the driver never imports it
        return helpers.triple(x)

    @cb.colocated_python
    def by_name(x, report):
        import importlib, json, os
        pkg = importlib.import_module("mine")
        here = os.path.dirname(pkg.__file__)
        files = sorted(os.path.relpath(os.path.join(d, f), here)
                       for d, _, fs in os.walk(here) for f in fs if "__pycache__" not in d)
        with open(report, "w") as out:  # what the host got of the package
            json.dump(files, out)
        return x + pkg.VALUE

    @cb.colocated_python
    def nowhere(x):
        import no_such_module_anywhere
        return x

    @cb.colocated_python
    def installed_here_only(x):
        import installedpkg
        return x

    @cb.colocated_python
    async def on_the_loop(x):
        import helpers_for_async
        return x

    def error(call, x):
        try:
            np.asarray(call(x))
        except ModuleNotFoundError as exc:
            return [str(exc), *getattr(exc, "__notes__", [])]
        return ["no error"]

    key = cb.load_key(sys.argv[2])
    with cb.Controller(sys.argv[1], hosts=1, key=key, join_timeout=120,
                       relays=int(sys.argv[4])) as ctl:
        assert [r["hosts"] for r in ctl.stats()["relays"]] == [[0]] * int(sys.argv[4])
        x = cb.device_put(np.arange(3.0), ctl.devices()[0])
        out = {"helpers": np.asarray(use_helpers(x)).tolist(),
               "by_name": np.asarray(by_name(x, sys.argv[3])).tolist(),
               "again": np.asarray(use_helpers(x)).tolist(),
               "nowhere": error(nowhere, x),
               "installed": error(installed_here_only, x),
               "on_loop": error(on_the_loop, x)}
    print("RESULT", json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("relays", [0, 1], ids=["direct", "relayed"])
def test_modules_host_code_imports_travel_when_the_host_imports_them(tmp_path: Path,
                                                                    relays: int) -> None:
    drv, lib, site, empty = (tmp_path / d for d in ("driver", "lib", "site", "empty"))
    for d in (drv, lib, site, empty):
        d.mkdir()
    (drv / "run.py").write_text(DRIVER)
    (lib / "helpers.py").write_text("def triple(v):\n    return v * 3\n")
    (lib / "helpers_for_async.py").write_text("")
    pkg = lib / "mine"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 10\n")
    (pkg / "data" / "table.json").write_text("{}")
    (pkg / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (pkg / "id_rsa").chmod(0o600)  # only its owner may read it: never travels
    key_file = tmp_path / "cluster.key"
    write_key(str(key_file))
    (pkg / "copy.key").write_text(key_file.read_text())  # the controller's key, readable
    (pkg / "copy.key").chmod(0o644)
    outside = tmp_path / "credentials"
    outside.write_text("secret = 1\n")
    (pkg / "settings.ini").symlink_to(outside)  # a link out of the package
    # installed code on the driver's path (pip install --target): never travels
    (site / "installedpkg").mkdir()
    (site / "installedpkg" / "__init__.py").write_text("")
    (site / "installedpkg-1.0.dist-info").mkdir()
    (site / "installedpkg-1.0.dist-info" / "RECORD").write_text(
        "installedpkg/__init__.py,,\n")

    address = f"ipc://{tmp_path}/ctl.sock"
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "COLOBUS_KEY_FILE") and not k.startswith("COLOBUS_")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "colobus", "worker", "--connect", address, "--key-file",
         str(key_file), "--name", "far", "--devices", "1"],
        cwd=empty, env={**clean, "COLOBUS_PARENT_PID": str(os.getpid())},
        stdin=subprocess.DEVNULL)
    try:
        proc = subprocess.run(
            [sys.executable, str(drv / "run.py"), address, str(key_file),
             str(tmp_path / "found.json"), str(relays)], cwd=drv,
            env={**clean, "PYTHONPATH": os.pathsep.join((str(lib), str(site)))},
            capture_output=True, text=True, timeout=300)
    finally:
        worker.terminate()
        worker.wait(30)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line.split(" ", 1)[1])
    assert out["helpers"] == [0.0, 3.0, 6.0] and out["again"] == [0.0, 3.0, 6.0]
    assert out["by_name"] == [10.0, 11.0, 12.0]
    # what the host got of the package: its code and data, none of what never travels
    found = json.loads((tmp_path / "found.json").read_text())
    assert found == ["__init__.py", "data/table.json"], found
    assert "mine/id_rsa: only its owner may read it" in proc.stderr, proc.stderr[-3000:]
    assert "mine/copy.key: it holds the controller's key" in proc.stderr
    assert "mine/settings.ini: a link to a file outside the package" in proc.stderr
    # nowhere: the host lacks it, and so does the controller
    message, *notes = out["nowhere"]
    assert message == "No module named 'no_such_module_anywhere'"
    assert any("this host lacks the module 'no_such_module_anywhere', and the controller "
               "could not provide it: the controller cannot import" in n for n in notes), notes
    # installed on the controller only: the host's to install
    message, *notes = out["installed"]
    assert message == "No module named 'installedpkg'"
    assert any("'installedpkg' is an installed package on the controller" in n
               and "install it on this host" in n for n in notes), notes
    # on the worker's event loop nothing can wait for the controller: it says so
    message, *notes = out["on_loop"]
    assert message == "No module named 'helpers_for_async'"
    assert any("imported on the worker's event loop (async def host code)" in n
               for n in notes), notes

