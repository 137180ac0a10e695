"""What lives on a host for one controller session: arrays, call results, objects, code.

Entries are ``asyncio.Future`` objects on the worker's loop (a PUT or a call may
still be converting or running when a later call names it). A call result is
kept while the controller's Future of that call is alive (so it can be passed
to later calls), but only as the *names* of its output arrays once the call
ended: deleting an output array frees its memory even while the result is kept.
Every table counts in :meth:`Store.counts`, which the heartbeat reports.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

from .._wire import protocol as P
from .._wire.envelope import Envelope, loads
from .shipped import ShippedCode

log = logging.getLogger("colobus.worker")

__all__ = ["CallResult", "Store", "load_failure_note"]

_Future = asyncio.Future

# What a missing array's KeyError says about it: the last PUTs and releases of this
# session (ref, envelope sequence number), bounded (a flake seen in full test runs).
HISTORY = 1024

_SHIP_ADVICE = ("name it in py_modules= (Controller, local_cluster, ssh_cluster, "
                "slurm_cluster), or leave ship_code=True (the default) so that your own "
                "modules travel with the calls")


def load_failure_note(name: str, exc: BaseException, where: str) -> str:
    """The note on a function or class (``module.qualname``) that does not load on a host.

    A module missing that is not the function's own top-level package is most likely an
    installed dependency (``scipy``), which colobus never ships: the note names it and
    says it is the user's to install; the advice to ship code is for the user's modules.
    """
    head = f"colobus: {name} cannot be loaded on {where}"
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    top = missing.partition(".")[0] if missing else None
    if top is None or top == name.partition(".")[0]:
        return f"{head}: install its package there, {_SHIP_ADVICE}"
    return (f"{head}: it needs the module {missing!r}, which is not installed there. "
            f"Installed dependencies are yours to install on the hosts (the package that "
            f"provides {top!r}, in the environment the workers run in); colobus ships only "
            f"your own modules. If {top!r} is a module of yours, {_SHIP_ADVICE}")


class CallResult:
    """A finished call's outputs: their tree, their array refs, and (while a call
    that names this result waits for it) their values."""

    __slots__ = ("refs", "treedef", "values")

    def __init__(self, treedef: Any, refs: list[int], values: list[Any] | None) -> None:
        self.treedef = treedef
        self.refs = refs
        self.values = values

    def tree(self, present: Any) -> Any:
        """The output tree as user code receives it."""
        assert self.values is not None
        return self.treedef.unflatten([present(v) for v in self.values])


class Store:
    """The host's tables for one session (loop thread).

    Args:
        dropped: the worker's counts of dropped messages, by reason (quoted when a
            call names an array this host does not hold).
    """

    def __init__(self, dropped: dict[str, int] | None = None) -> None:
        self.dropped = dropped if dropped is not None else {}
        # Diagnosis only: recent PUTs and releases of arrays held, (ref, seq).
        self.puts: collections.deque[tuple[int, int]] = collections.deque(maxlen=HISTORY)
        self.released: collections.deque[tuple[int, int]] = collections.deque(maxlen=HISTORY)
        self.sessions = 0  # sessions ended (clear() calls)
        self.since = time.monotonic()  # when this session's tables began
        self.code: dict[bytes, tuple[str, Any]] = {}
        self.code_bytes: dict[bytes, int] = {}  # digest -> its pickle's size
        self.shipped = ShippedCode()  # the user's packages, in this session's directory
        self.arrays: dict[int, asyncio.Future[Any]] = {}
        # call id -> the running call's future (of a CallResult), or a finished call's
        # CallResult without values (names only)
        self.results: dict[int, asyncio.Future[Any] | CallResult] = {}
        # A call a FETCH_CALL waits for, not ended when it arrived -> that FETCH's id, or
        # minus it once the call's RESULT said computed and the answer went with it (the
        # thread that runs the call inline waits for its outputs first: colobus._host.runs).
        self.awaited: dict[int, int] = {}
        self.objects: dict[int, asyncio.Future[Any]] = {}
        self.obj_calls: dict[int, set[asyncio.Future[Any]]] = {}  # obj -> its calls' results
        self.classes: dict[int, bytes] = {}  # obj -> its class's code digest
        self.reshards: dict[int, Any] = {}  # new array ref -> its block being assembled
        self.trees: dict[int, Any] = {}  # TREEPUT call id -> its block (_host/treeput)
        # call id -> outputs released while the call ran (their handles went before it
        # ended): not stored when it ends
        self.gone_early: dict[int, set[int]] = {}

    def clear(self) -> None:
        self.shipped.clear()
        self.code.clear()
        self.code_bytes.clear()
        self.arrays.clear()
        self.results.clear()
        self.awaited.clear()
        self.objects.clear()
        self.obj_calls.clear()
        self.classes.clear()
        self.reshards.clear()
        self.trees.clear()
        self.gone_early.clear()
        self.puts.clear()
        self.released.clear()
        self.sessions += 1
        self.since = time.monotonic()

    def counts(self) -> tuple[int, int, int, int]:
        """Arrays, their bytes, objects, and call results held."""
        nbytes = 0
        for f in self.arrays.values():
            if f.done() and not f.cancelled() and f.exception() is None:
                nbytes += int(getattr(f.result(), "nbytes", 0))
        return len(self.arrays), nbytes, len(self.objects), len(self.results)

    def get_code(self, digest: bytes) -> Any:
        state, value = self.code.get(digest, ("error", None))
        if state == "error":
            if value is None:
                raise RuntimeError(f"code {digest.hex()[:12]} was never sent to this host")
            raise value
        return value

    def release(self, refs: list[int], calls: list[int], code: Sequence[bytes] = (),
                seq: int = 0) -> None:
        arrays, released = self.arrays, self.released
        for ref in refs:
            if arrays.pop(ref, None) is not None:
                released.append((ref, seq))
            else:  # an output of a call still running here: dropped as it ends
                running = self.results.get(ref >> 16)
                if isinstance(running, asyncio.Future) and not running.done():
                    self.gone_early.setdefault(ref >> 16, set()).add(ref)
        for call_id in calls:
            self.results.pop(call_id, None)
        for digest in code:  # calls queued with it hold the function itself (_Call.code)
            self.code.pop(digest, None)
            self.code_bytes.pop(digest, None)

    def add_code(self, body: P.Code, env: Envelope) -> None:
        """A CODE message: a package to unpack, or the function or class (or why it does
        not load here: the calls naming it raise that, with a note saying what to do)."""
        digest, name = body.digest, body.name or body.digest.hex()[:12]
        if body.package:  # later messages wait for it
            self.shipped.install(body.name, digest, bytes(env.payload))
            return
        try:
            # Its own package did not unpack: fail with why, not with a same-named module
            # of this worker's sys.path (the pickle's imports meet the same refusal).
            refused = self.shipped.why_refused(body.name) if self.shipped.refused else None
            if refused is not None:
                raise ImportError(refused, name=body.name)
            self.code[digest] = ("ok", loads(env.payload, env.buffers[: env.pbufs]))
            self.code_bytes[digest] = len(env.payload)
        except Exception as exc:
            log.warning("code %s (%s) does not load here: %r", name, digest.hex()[:12], exc)
            exc.add_note(load_failure_note(name, exc, socket.gethostname()))
            self.code[digest] = ("error", exc)

    def code_figures(self) -> tuple[int, int]:
        """Code held: (functions and classes, bytes of their pickles)."""
        return len(self.code), sum(self.code_bytes.values())

    def store_outputs(self, call_id: int, values: list[Any], treedef: Any,
                      loop: asyncio.AbstractEventLoop | None = None) -> CallResult:
        """Keep a finished call's output values as arrays (but those released while it
        ran); its result keeps their names.

        ``loop``: the running loop, where the caller knows it (on Python 3.11 asking for
        it costs a ``getpid`` system call)."""
        if loop is None:
            loop = asyncio.get_running_loop()
        refs = []
        gone = self.gone_early.pop(call_id, None) if self.gone_early else None
        for i, value in enumerate(values):
            ref = (call_id << 16) | i  # P.output_ref(call_id, i)
            refs.append(ref)
            if gone is not None and ref in gone:
                continue  # its handle went while the call ran: nobody will read it
            fut: asyncio.Future[Any] = _Future(loop=loop)  # (create_future: a call more)
            fut.set_result(value)
            self.arrays[ref] = fut
        if call_id in self.results:  # not released meanwhile
            self.results[call_id] = CallResult(treedef, refs, None)
        return CallResult(treedef, refs, values)

    def entry(self, ref: int) -> asyncio.Future[Any] | None:
        """Array ``ref``'s entry, or None. An output of a call still queued or running
        here (the controller hands a call's outputs on before the call ended, as JAX
        hands on a dispatched computation's arrays): a future of that output, failing
        with the call's error if it fails."""
        fut = self.arrays.get(ref)
        if fut is not None:
            return fut
        running = self.results.get(ref >> 16)  # (P.output_ref: the call id, the index)
        if not isinstance(running, asyncio.Future):
            return None
        out: asyncio.Future[Any] = running.get_loop().create_future()
        index = ref & 0xFFFF
        if running.done():
            _output_of(out, running, index, self.arrays, ref)
        else:
            running.add_done_callback(
                lambda f: _output_of(out, f, index, self.arrays, ref))
        return out

    def pin(self, ref: Any, host_index: int, seq: int = 0) -> asyncio.Future[Any]:
        """The store entry a call argument names, taken now (a later RELEASE can't race).

        ``seq``: the sequence number of the envelope that names it (for the error).
        """
        tag, ident = ref[0], ref[1]  # (a JAX job's array entries carry a layout third)
        fut: asyncio.Future[Any] | None
        if tag == 1:
            fut = self._pin_result(ident, host_index)
        elif tag == 0:
            fut = self.entry(ident)
        else:
            fut = self.objects.get(ident)
        if fut is None:
            what = ("array", "call result", "object")[tag]
            text = f"{what} {ident} is not on host {host_index}"
            if tag == 0:
                text += f" ({self.why_missing(ident, seq)})"
            fut = _failed(KeyError(text))
        return fut

    def why_missing(self, ref: int, seq: int) -> str:
        """What this host knows of array ``ref``, which a message at ``seq`` named."""
        put = [s for r, s in self.puts if r == ref]
        gone = [s for r, s in self.released if r == ref]
        if gone:
            seen = f"released by the RELEASE at seq {gone[-1]}"
        elif put:
            seen = f"PUT, and no RELEASE of it among this session's last {len(self.released)}"
        else:
            seen = f"no PUT of it among this session's last {len(self.puts)}"
        if put:
            seen += f"; its PUT came at seq {put[-1]}"
        age = time.monotonic() - self.since
        return (f"named at seq {seq}: {seen}; session {self.sessions + 1} of this worker, "
                f"{age:.1f} s old, holding {len(self.arrays)} arrays; "
                f"dropped here: {dict(self.dropped)}")

    def _pin_result(self, call_id: int, host_index: int) -> asyncio.Future[Any] | None:
        entry = self.results.get(call_id)
        if entry is None or isinstance(entry, asyncio.Future):
            return entry
        values = []
        for ref in entry.refs:
            f = self.arrays.get(ref)
            if f is None:
                return _failed(KeyError(
                    f"an output of call {call_id} was deleted on host {host_index}; "
                    "a deleted array cannot be used"))
            values.append(f.result())
        done = asyncio.get_running_loop().create_future()
        done.set_result(CallResult(entry.treedef, entry.refs, values))
        return done


def _output_of(out: asyncio.Future[Any], call: asyncio.Future[Any], index: int,
               arrays: dict[int, asyncio.Future[Any]], ref: int) -> None:
    """Settle ``out`` with output ``index`` of a call that ended (``call``: its result)."""
    if out.done():
        return
    exc: BaseException | None
    if call.cancelled():
        exc = KeyError(f"array {ref}: the call that makes it was cancelled")
    else:
        exc = call.exception()
    if exc is None:
        stored = arrays.get(ref)  # (stored by then, unless released since)
        values = call.result().values
        if stored is not None and stored.done() and stored.exception() is None:
            out.set_result(stored.result())
            return
        if values is not None and 0 <= index < len(values):
            out.set_result(values[index])
            return
        exc = KeyError(f"array {ref} is not an output of its call on this host")
    out.set_exception(exc)
    out.exception()  # retrieved: no "never retrieved" log when dropped


def _failed(exc: BaseException) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    fut.exception()  # retrieved: no "never retrieved" log when dropped
    return fut
