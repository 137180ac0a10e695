"""Errors that point the right way: each mistake a newcomer makes first, by its text."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from nsprocs import run_cli

import colobus as cb


@cb.colocated_python
def add_one(x):
    return x + 1


@cb.colocated_python
def returns_a_string(x):
    return {"ok": x, "bad": [x, "a string"]}


@cb.colocated_python
def opens_a_missing_file(x):
    with open("/nonexistent-colobus-dir/data.txt"):
        return x


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("value", [np.arange(3), jnp.arange(3)], ids=["numpy", "jax"])
def test_a_driver_array_as_the_only_argument_says_to_device_put_it(
        ctl: cb.Controller, value: object) -> None:
    with pytest.raises(ValueError) as info:
        add_one(value)
    # JAX's text, unchanged, then what to do about it: in the message, which a bare
    # `except Exception as e: print(e)` shows, and in more words in the note.
    message = str(info.value)
    assert message.startswith("No devices found. colocated_python function without input "
                              "arguments must be first specialized with devices. colobus: ")
    assert "no cb.Array" in message and "cb.device_put" in message, message
    note = _notes(info.value)
    assert "no cb.Array among them" in note and "cb.device_put(" in note, note
    kind = "numpy.ndarray" if isinstance(value, np.ndarray) else "jax.Array of this process"
    assert f"({'a ' + kind} first)" in note, note


def test_a_non_array_output_names_the_function_and_the_leaf(ctl: cb.Controller) -> None:
    x = cb.device_put(np.arange(2), cb.devices()[0])
    with pytest.raises(ValueError) as info:
        cb.block_until_ready(returns_a_string(x))
    assert str(info.value) == ("colocated_python only supports jax.Array as input and output, "
                               "but got <class 'str'>.")
    note = _notes(info.value)
    assert "output['bad'][1] of test_pointing_errors.returns_a_string is a str" in note, note


def test_a_missing_file_on_a_host_shows_its_path_in_the_headline(ctl: cb.Controller) -> None:
    x = cb.device_put(np.arange(2), cb.devices()[0])
    with pytest.raises(FileNotFoundError) as info:
        cb.block_until_ready(opens_a_missing_file(x))
    assert str(info.value) == ("[Errno 2] No such file or directory: "
                               "'/nonexistent-colobus-dir/data.txt'")
    assert info.value.filename == "/nonexistent-colobus-dir/data.txt"


MAIN_SCRIPT = textwrap.dedent("""
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def fails(x):
        raise KeyError("from the script")  # the line the traceback shows

    with cb.local_cluster(hosts=1) as ctl:
        try:
            cb.block_until_ready(fails(cb.device_put(np.arange(2), cb.devices()[0])))
        except KeyError as exc:
            print("\\n".join(exc.__notes__))
""")


def test_host_code_of_main_shows_the_scripts_file_and_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f'File "{script}", line 7, in fails' in out.stdout, out.stdout
    assert 'raise KeyError("from the script")' in out.stdout
    assert "<dynamic-code>" not in out.stdout


def test_a_worker_without_its_key_file_is_told_to_copy_the_controllers(tmp_path: Path) -> None:
    missing = tmp_path / "colobus.key"
    out = run_cli(["worker", "--connect", "tcp://127.0.0.1:5555", "--key-file", str(missing)])
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert f"cannot read key file {missing} (no such file)" in line, line
    assert "needs the controller's key" in line and "copy the key file" in line, line
    assert "make one with" not in line


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_an_unresolvable_ssh_host_points_at_the_ssh_configuration() -> None:
    host = "no-such-host.invalid"
    with pytest.raises(OSError) as info:
        cb.ssh_cluster([host])
    text = str(info.value)
    assert f"ssh host {host!r} does not resolve" in text and "~/.ssh/config" in text, text
    assert "bind=" not in text
    out = run_cli(["launch", "ssh", host, "--", sys.executable, "-c", "pass"])
    assert out.returncode == 2
    assert f"colobus launch ssh: error: ssh host {host!r} does not resolve" in out.stderr
    assert "~/.ssh/config" in out.stderr


@pytest.mark.parametrize("command", [["demo", "--metrics"], ["bench", "calls", "--metrics"]])
def test_metrics_without_the_extra_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                               command: list[str]) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    out = run_cli(command)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"colobus {command[0]}: error: colobus {command[0]} --metrics needs the "
        "prometheus_client package: pip install 'colobus[metrics]'"), out.stderr
