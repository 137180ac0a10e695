"""Local worker processes: their output labelled with the host, their death told at once.

``local_cluster`` owns its workers' processes, so it need not wait for a
liveness timeout to learn that one died. :class:`HostProcess` reads a worker's
stdout and stderr on two threads and copies each line to this process's
``sys.stdout`` / ``sys.stderr`` behind a label, like IPython Parallel's
``[stdout:0]``; when stdout ends it waits for the process and calls
``on_exit`` with what ended it (``"killed by SIGKILL (out of memory?)"``).
Launchers pass ``emit`` to send the lines to logging with a ``[host N]`` prefix
instead; the last stderr lines are kept either way, for error messages.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["Emit", "HostProcess", "describe_exit"]

Emit = Callable[[int, str, str], None]  # (host number, "stdout" | "stderr", line)
STDERR_TAIL_LINES = 20


def describe_exit(code: int, hint: bool = True) -> str:
    """A process's end in words, from ``Popen.returncode`` (``hint``: say a SIGKILL
    may mean out of memory)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    said = " (out of memory?)" if hint and -code == signal.SIGKILL else ""
    return f"was killed by {name}{said}"


class HostProcess:
    """One local worker process, its output relayed with a ``[stdout:N]`` label.

    Args:
        index: the host number in the labels.
        name: the worker's ``--name``.
        proc: the process, started with ``stdout`` and ``stderr`` pipes.
        on_exit: called once, on a reader thread, with this object and
            :func:`describe_exit` of the process's status, when it ends.
        emit: where each line goes (default: this process's stdout or stderr,
            behind the label).
    """

    def __init__(self, index: int, name: str, proc: subprocess.Popen[bytes],
                 on_exit: Callable[[HostProcess, str], None], emit: Emit | None = None) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.index = index
        self.name = name
        self.proc = proc
        self._on_exit = on_exit
        self._emit = emit
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._threads = [
            threading.Thread(target=self._relay, args=(proc.stdout, "stdout", True),
                             name=f"colobus-{name}-stdout", daemon=True),
            threading.Thread(target=self._relay, args=(proc.stderr, "stderr", False),
                             name=f"colobus-{name}-stderr", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _relay(self, pipe: IO[bytes], stream: str, watch_exit: bool) -> None:
        label = f"[{stream}:{self.index}] "
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                if stream == "stderr":
                    self.stderr_tail.append(line.rstrip("\n"))
                if self._emit is not None:
                    self._emit(self.index, stream, line.rstrip("\n"))
                    continue
                out = sys.stdout if stream == "stdout" else sys.stderr
                try:
                    out.write(label + line if line.endswith("\n") else label + line + "\n")
                    out.flush()
                except (OSError, ValueError):  # our own stream is closed: drop the line
                    pass
        if watch_exit:
            self._on_exit(self, describe_exit(self.proc.wait()))

    def join(self, timeout: float) -> None:
        """Wait (up to ``timeout`` each) for the relays to copy the last lines."""
        for t in self._threads:
            if t is not threading.current_thread():  # on_exit runs on the stdout relay
                t.join(timeout)
