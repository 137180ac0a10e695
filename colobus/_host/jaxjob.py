"""The host's side of the cluster's JAX job (``jax_distributed``).

With ``jax_distributed`` on, once every host joined, the controller sends each
worker a FORM: join JAX's multi-controller job as process ``host index`` of
``hosts``, its coordination service run by the controller. :class:`HostJob` joins
(:meth:`HostJob.join`, on a thread of its own: it blocks until every process is in),
and leaves when the colobus session ends (:meth:`HostJob.leave`).

JAX must join a job before it makes its backend, and a worker made its backend
long before (to report its devices at join). So joining drops the worker's backend
(``xla_bridge._clear_backends`` and JAX's caches: nothing of the session exists
yet, a job forms only over fresh sessions), connects JAX's distributed client by
hand (``jax.distributed.initialize`` would start a second coordination service in
process 0) to this worker's own Unix socket, carried to the controller's service over
the colobus link (:mod:`colobus._host.coordfwd`), with JAX's CPU collectives on gloo,
and lets JAX make the job's backend at its next use. Leaving resets JAX's distributed
state and drops the backend again.

Nothing of JAX may end the worker. jaxlib's client ends its process on any error it
hears of (a broken connection, a service that stops, a timeout of its own), and the
callback it takes for that cannot be replaced from Python (jaxlib 0.10 aborts while
casting the status it would pass). So: its timeouts (heartbeats, the wait for every
process to register) are set beyond any session, colobus judges liveness; its
connections are never closed while it may use them (the forwarder goes dark when the
session ends, and closes them only once the client was shut down, which with
``shutdown_on_destruction=False`` is local: it stops the client's heartbeats and
polls and tells the service nothing); the controller cuts its side before a service
stops. JAX's preemption sync manager is not made: it would take SIGTERM for good.

In a job, host code sees global arrays: :meth:`HostJob.view` turns a stored block
into the global ``jax.Array`` of the argument's layout (the controller sends the
layout with the call: ``colobus._api.joblayout``), made once per stored value and
layout; :meth:`HostJob.to_blocks` turns a global output back into this host's
block, which the host stores and reports as every output.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .._model.devices import jax_axis_types
from .._wire import protocol as P
from .reach import probe_peers
from .values import is_string

if TYPE_CHECKING:
    from .coordfwd import Forwarder

__all__ = ["GLOO_ADDRESS_ENV", "JAX_HEARTBEAT_S", "HostJob", "gloo_address"]

log = logging.getLogger("colobus.worker")

GLOO_ADDRESS_ENV = "COLOBUS_GLOO_ADDRESS"  # where this host's gloo listens (an address)
JAX_HEARTBEAT_S = 86400  # JAX's heartbeat timeouts: colobus, not JAX, judges liveness
JAX_CONNECT_S = 1 << 30  # JAX's own wait to connect: never (colobus bounds the FORM)
RETIRE_GRACE_S = 1.0  # a shut-down client's cancelled calls end before its sockets close
_VIEWS_MAX = 4096  # global views kept (per stored value and layout); all dropped when full


class _Member:
    """One generation's JAX client and its way to the service, until retired."""

    __slots__ = ("client", "connected", "forwarder", "left")

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder
        self.client: Any = None
        self.connected = False  # its connect() returned
        self.left = False  # the session ended: retire it once connected

    def retire(self) -> None:
        """Shut the client down (locally: no call to the service), then close its
        connections, on a daemon thread (a call of its in flight can hold the shutdown)."""

        def shut() -> None:
            client = self.client
            try:
                if client is not None:
                    client.shutdown()
            except Exception as exc:  # (an agent already in error: stopped all the same)
                log.debug("leaving the JAX job: %s", exc)
            time.sleep(RETIRE_GRACE_S)
            self.forwarder.close_soon()

        threading.Thread(target=shut, name="colobus-jax-leave", daemon=True).start()


class HostJob:
    """This worker as a process of the cluster's JAX job: joining, leaving, global views.

    Args:
        jax: the worker's ``jax`` module.
    """

    def __init__(self, jax: Any) -> None:
        self.jax = jax
        self.index = -1  # this host's process index in the job (-1: not in one)
        self.generation = 0
        self.ever = False  # a job formed in this process once (exit skips finalization)
        self.gloo_host: str | None = None  # where this host's gloo listens (None: JAX's pick)
        self._member: _Member | None = None  # this generation's client, until it leaves
        self._cpu_factory = False  # JAX's CPU backend is made by _own_cpu_backend's
        self._lock = threading.Lock()
        # id(stored value) -> (a weak reference to it, the layout, its global view)
        self._views: dict[int, tuple[Any, bytes, Any]] = {}
        # id(global view) -> a weak reference to the stored value it was made of
        self._blocks: dict[int, Any] = {}
        self._shardings: dict[bytes, tuple[tuple[int, ...], Any]] = {}  # layout -> sharding
        # id(a sharding outputs had) -> (it, whether this process addresses all of it)
        self.addressable: dict[int, tuple[Any, bool]] = {}
        self._local_meshes: dict[tuple[Any, ...], Any] = {}
        # an argument's global sharding -> its stored block's sharding on this host: a
        # global output laid out like an argument is stored with the argument's block
        # sharding, so its description names that argument (its global layout, which
        # the call's mesh need not be: another device order)
        self._arg_blocks: dict[Any, Any] = {}

    # -- joining and leaving ------------------------------------------------------------

    def join(self, body: P.Form, host: int, connect: str, reported: int,
             forwarder: Forwarder) -> tuple[list[Any], dict[int, Any]]:
        """Join the job of ``body`` as process ``host`` (blocking: a thread of its own),
        JAX's client reaching the service through ``forwarder``.

        Returns this host's JAX devices in the job (in the order the worker reported
        its devices) and every host's, by id (in a job a device's colobus id is JAX's).

        Raises:
            RuntimeError: JAX lacks what joining needs, the session ended meanwhile, or
                the job's devices do not match what hosts reported.
        """
        jax = self.jax
        self.leave()
        try:
            from jax._src import distributed
            from jax._src import xla_bridge as xb
            from jax._src.lib import _jax  # type: ignore[attr-defined]
        except ImportError as exc:  # pragma: no cover - a JAX without these
            raise RuntimeError(f"this JAX ({jax.__version__}) cannot join a job the way "
                               f"colobus joins one: {exc}") from exc
        member = _Member(forwarder)
        with self._lock:
            self._member = member
        self._drop_backend(jax, xb)
        if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        self.gloo_host = gloo_address(connect)
        self._own_cpu_backend(jax, xb, distributed, _jax)
        self.ever = True  # (from here a thread may wait in JAX for good: exit skips finalization)
        try:
            member.client = client = _jax.get_distributed_runtime_client(
                forwarder.address, host, init_timeout=JAX_CONNECT_S,
                heartbeat_timeout=JAX_HEARTBEAT_S, shutdown_on_destruction=False,
                use_compression=True)
            client.connect()  # (until every process is in: its failures end the process)
        except Exception as exc:  # (a client that could not even try)
            with self._lock:
                member.connected, left = True, member.left
            if left:
                member.retire()
            raise RuntimeError(f"host {host} could not join the JAX job: {exc}") from exc
        with self._lock:
            member.connected = True
            left = member.left
        if left:
            member.retire()
            raise RuntimeError("the session ended while this host joined the JAX job")
        state = distributed.global_state
        state.client = client
        state.process_id = host
        state.num_processes = body.processes
        state.coordinator_address = forwarder.address
        self.index = host
        self.generation = body.generation
        # (every host probes, before any can fail for its own reasons: none waits alone;
        # hosts on one machine, over ipc://, are not probed)
        probe_peers(client, host, body.processes, body.generation,
                    self.gloo_host if connect.startswith("tcp://") else None,
                    max(1.0, body.timeout))
        mine = _process_devices(jax, host)
        if len(mine) != reported:
            raise RuntimeError(
                f"host {host} has {len(mine)} JAX devices in the job, but reported {reported} "
                "at join: its JAX sees other devices once in a job (JAX_PLATFORMS, "
                "visible devices)")
        every: dict[int, Any] = {}
        for h, ids in enumerate(body.devices):
            devs = mine if h == host else _process_devices(jax, h)
            if len(devs) != len(ids):
                raise RuntimeError(f"host {h} has {len(devs)} JAX devices in the job, but "
                                   f"reported {len(ids)} at join")
            every.update((d.id, d) for d in devs)  # (a job's colobus ids are JAX's)
        return mine, every

    @property
    def forwarder(self) -> Forwarder | None:
        """The way to the current job's service (None: in no job, or leaving it)."""
        member = self._member
        return member.forwarder if member is not None else None

    def leave(self) -> None:
        """Leave the job (if in one): JAX's distributed state reset and its backend
        dropped, so the next use makes a backend of this process alone; its client is
        retired (at once, or once its connect returns)."""
        self.clear()
        with self._lock:
            member, self._member = self._member, None
            if member is not None:
                member.left = True
                member.forwarder.go_dark()
        if member is not None and member.connected:
            member.retire()
        if self.index < 0:
            return
        self.index = -1
        from jax._src import distributed
        from jax._src import xla_bridge as xb

        state = distributed.global_state
        state.client = state.preemption_sync_manager = state.service = None
        state.process_id, state.num_processes = 0, 1
        self._drop_backend(self.jax, xb)

    def _own_cpu_backend(self, jax: Any, xb: Any, distributed: Any, _jax: Any) -> None:
        """JAX's CPU backend, made so that gloo listens where the other hosts reach this
        one: the address this worker reaches the controller from. JAX's own factory lets
        gloo take the machine's name, which often resolves to a loopback address
        (127.0.1.1 on Debian, 127.0.0.1 in a container or namespace)."""
        if self._cpu_factory:
            return

        def cpu_backend() -> Any:
            client = distributed.global_state.client
            host = self.gloo_host
            if (client is None or host is None or getattr(
                    jax.config, "jax_cpu_collectives_implementation", None) != "gloo"):
                return xb.make_cpu_client()
            return xb.make_cpu_client(collectives=_jax.make_gloo_tcp_collectives(
                distributed_client=client, hostname=host))

        xb.register_backend_factory("cpu", cpu_backend, priority=0, fail_quietly=False)
        self._cpu_factory = True

    @staticmethod
    def _drop_backend(jax: Any, xb: Any) -> None:
        xb._clear_backends()
        jax.clear_caches()  # (get_backend, process_count, local_devices are cached)

    def clear(self) -> None:
        """Forget the global views (the session that stored their values ended)."""
        with self._lock:
            self._views.clear()
            self._blocks.clear()
            self._shardings.clear()
            self._local_meshes.clear()
            self._arg_blocks.clear()
            self.addressable.clear()

    # -- the global view of arguments -------------------------------------------------------

    def view(self, value: Any, layout: bytes) -> Any:
        """The global ``jax.Array`` host code sees for the stored block ``value`` of an
        argument whose global layout is ``layout`` (made once, then kept while
        ``value`` lives); ``value`` itself where it is no ``jax.Array``."""
        hit = self._views.get(id(value))
        if hit is not None and (hit[1] == layout or not hit[1]) and hit[0]() is value:
            return hit[2]
        jax = self.jax
        if not isinstance(value, jax.Array) or is_string(value.dtype):
            # (numpy blocks of dtypes JAX cannot hold, strings JAX holds on one device but
            # cannot make a global array of: the block as it is, as in the block view)
            return value
        shape, sharding = self._sharding(layout)
        try:
            out = jax.make_array_from_single_device_arrays(
                shape, sharding, [s.data for s in value.addressable_shards])
        except Exception as exc:
            raise ValueError(
                f"colobus: an argument's block {value.shape} does not make the global array "
                f"{shape} of {sharding} on host {self.index} ({exc}); in a JAX job, shards "
                "must divide the array evenly, as JAX requires") from exc
        self._remember(value, layout, out)
        with self._lock:
            if len(self._arg_blocks) > 256:
                self._arg_blocks.clear()
            self._arg_blocks[sharding] = value.sharding
        return out

    def known(self, value: Any) -> Any:
        """The global array a call's output ``value`` (or a pytree of them) was made of
        on this host, where host code returned it global; else ``value``."""
        views = self._views
        if not views:
            return value
        hit = views.get(id(value))
        if hit is not None and hit[0]() is value:
            return hit[2]
        jax = self.jax
        if isinstance(value, jax.Array) or value is None:
            return value
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if not leaves or not any(id(x) in views for x in leaves):
            return value
        return treedef.unflatten([self.known(x) if id(x) in views else x for x in leaves])

    def _remember(self, block: Any, layout: bytes, out: Any) -> None:
        key, gkey = id(block), id(out)
        ref = weakref.ref(block, lambda _: self._forget(key, gkey))
        with self._lock:
            if len(self._views) >= _VIEWS_MAX:
                self._views.clear()
                self._blocks.clear()
            self._views[key] = (ref, layout, out)
            self._blocks[gkey] = ref

    def _forget(self, key: int, gkey: int) -> None:
        with self._lock:
            self._views.pop(key, None)
            self._blocks.pop(gkey, None)

    def _sharding(self, layout: bytes) -> tuple[tuple[int, ...], Any]:
        hit = self._shardings.get(layout)
        if hit is not None:
            return hit
        from .._model import jaxside

        shape, kind, ids, mesh_shape, names, spec, memory, *types = msgpack.unpackb(layout)
        jax = self.jax
        devs = [jaxside._devices[i] for i in ids]
        if kind == "single":
            sharding = jax.sharding.SingleDeviceSharding(devs[0], memory_kind=memory)
        else:
            grid = np.array(devs, dtype=object).reshape(mesh_shape)
            mesh = (jax.sharding.Mesh(grid, tuple(names), axis_types=jax_axis_types(
                jax, [str(t) for t in types[0]])) if types  # (only where one is not Auto)
                else jax.sharding.Mesh(grid, tuple(names)))
            sharding = jax.sharding.NamedSharding(mesh, P.decode_spec(spec),
                                                  memory_kind=memory)
        hit = (tuple(shape), sharding)
        with self._lock:
            if len(self._shardings) > 256:
                self._shardings.clear()
            self._shardings[layout] = hit
        return hit

    # -- outputs: global arrays back to this host's blocks ----------------------------------

    def to_blocks(self, out: Any) -> Any:
        """``out`` with each global ``jax.Array`` (one spanning other hosts) replaced by this
        host's block of it; a global view of an argument becomes that argument's block."""
        jax = self.jax
        if isinstance(out, jax.Array):
            return self._block(out)
        leaves, treedef = jax.tree_util.tree_flatten(out)
        if not any(isinstance(x, jax.Array) for x in leaves):
            return out
        return treedef.unflatten([self._block(x) if isinstance(x, jax.Array) else x
                                  for x in leaves])

    def _block(self, x: Any) -> Any:
        ref = self._blocks.get(id(x))
        if ref is not None:
            hit = self._views.get(id(ref()))
            if hit is not None and hit[2] is x:
                return hit[0]()
        sh = x.sharding
        known = self.addressable.get(id(sh))
        if known is None or known[0] is not sh:
            known = (sh, bool(sh.is_fully_addressable))
            if len(self.addressable) > 1024:
                self.addressable.clear()
            self.addressable[id(sh)] = known  # (held: its id stays its own)
        if known[1]:
            return x
        block = self._local_part(x)
        self._remember(block, b"", x)  # (passed on as a future, it arrives global again)
        return block

    def _local_part(self, x: Any) -> Any:
        """This host's block of the global array ``x``: the box its devices hold, over
        its part of the mesh, with the same spec."""
        jax = self.jax
        sh = x.sharding
        if not isinstance(sh, jax.sharding.NamedSharding):
            raise ValueError(
                f"colobus: host code returned a global array with a {type(sh).__name__}; in "
                "a JAX job, return global arrays with a NamedSharding (jax.jit(..., "
                "out_shardings=NamedSharding(mesh, spec)))")
        mesh = sh.mesh
        me = self.index
        key = (id(mesh), mesh.devices.shape, mesh.axis_names, me)
        local = self._local_meshes.get(key)
        if local is None or local[0] is not mesh:
            positions = [p for p, d in np.ndenumerate(mesh.devices) if d.process_index == me]
            if not positions:
                raise ValueError(f"colobus: host code on host {me} returned a global array "
                                 "with no device on this host")
            coords = tuple(sorted({p[a] for p in positions}) for a in range(mesh.devices.ndim))
            sub = mesh.devices[np.ix_(*coords)]
            if sub.size != len(positions):
                raise ValueError(
                    f"colobus: the devices of host {me} do not form a sub-box of the mesh of "
                    "a global array host code returned, so it has no block on this host")
            types = getattr(mesh, "axis_types", None)  # (a JAX with axis types: keep them)
            local = (mesh, jax.sharding.Mesh(sub, mesh.axis_names) if types is None
                     else jax.sharding.Mesh(sub, mesh.axis_names, axis_types=types))
            with self._lock:
                if len(self._local_meshes) > 256:
                    self._local_meshes.clear()
                self._local_meshes[key] = local
        indices = sh.devices_indices_map(x.shape)
        starts, stops = _box([indices[d] for d in local[1].devices.flat], x.shape)
        shape = tuple(b - a for a, b in zip(starts, stops, strict=True))
        block_sharding = self._arg_blocks.get(sh)  # (laid out like an argument: its block's)
        if block_sharding is None or block_sharding.mesh.devices.tolist() != (
                local[1].devices.tolist()) or block_sharding.spec != sh.spec:
            block_sharding = jax.sharding.NamedSharding(local[1], sh.spec,
                                                        memory_kind=sh.memory_kind)
        return jax.make_array_from_single_device_arrays(
            shape, block_sharding, [s.data for s in x.addressable_shards])


def gloo_address(connect: str) -> str | None:
    """Where this host's gloo listens for the other hosts: ``$COLOBUS_GLOO_ADDRESS``, else
    this machine's address toward the controller at ``connect`` (loopback over ``ipc://``:
    the hosts share this machine); None: JAX's pick (the machine's name)."""
    fixed = os.environ.get(GLOO_ADDRESS_ENV, "").strip()
    if fixed:
        return fixed.strip("[]")
    if not connect.startswith("tcp://"):
        return "127.0.0.1"
    return _facing(connect)


def _facing(connect: str) -> str | None:
    """This machine's address toward the controller at ``connect`` (None: ``ipc://``,
    the hosts share this machine, or no route to tell)."""
    if not connect.startswith("tcp://"):
        return None
    host, _, port = connect[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # (a datagram socket: nothing is sent)
            return str(s.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return None


def _box(indices: Sequence[tuple[slice, ...]], shape: tuple[int, ...]
         ) -> tuple[list[int], list[int]]:
    """The smallest box holding every index (the host's block: its devices' shards)."""
    starts = [min(ix[a].indices(n)[0] for ix in indices) for a, n in enumerate(shape)]
    stops = [max(ix[a].indices(n)[1] for ix in indices) for a, n in enumerate(shape)]
    return starts, stops


def _process_devices(jax: Any, process: int) -> list[Any]:
    """Process ``process``'s JAX devices in the job, as a worker lists its own: its
    accelerators (if any), then its CPU devices."""
    devices: list[Any] = []
    if jax.default_backend() != "cpu":
        devices.extend(d for d in jax.devices() if d.process_index == process)
    devices.extend(d for d in jax.devices("cpu") if d.process_index == process)
    return devices
