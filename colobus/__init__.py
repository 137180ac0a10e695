"""colobus: run Python colocated with the devices of many hosts, from one controller.

The API follows ``jax.experimental.colocated_python``; every remote operation
returns a :class:`Future` that can be awaited from any event loop.

The public names are imported on first use (PEP 562), so ``import colobus`` and
the command line's quick commands (``colobus --version``, ``keygen``) import
neither JAX nor numpy; ``PartitionSpec`` is JAX's own class,
``jax.sharding.PartitionSpec``.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from jax.sharding import PartitionSpec as PartitionSpec

    from ._api.array import Array as Array
    from ._api.entry import colocated_cpu_devices as colocated_cpu_devices
    from ._api.entry import devices as devices
    from ._api.entry import make_mesh as make_mesh
    from ._api.fetch import device_get as device_get
    from ._api.func import colocated_python as colocated_python
    from ._api.gather import gather as gather
    from ._api.obj import aclose as aclose
    from ._api.obj import close as close
    from ._api.obj import colocated_python_class as colocated_python_class
    from ._api.put import device_put as device_put
    from ._api.ready import block_until_ready as block_until_ready
    from ._controller.controller import Controller as Controller
    from ._controller.controller import HostInfo as HostInfo
    from ._controller.future import Future as Future
    from ._errors import AuthenticationError as AuthenticationError
    from ._errors import ColobusError as ColobusError
    from ._errors import ControllerClosedError as ControllerClosedError
    from ._errors import HostLostError as HostLostError
    from ._errors import NoControllerError as NoControllerError
    from ._errors import ProtocolError as ProtocolError
    from ._errors import RemoteError as RemoteError
    from ._errors import SerializationError as SerializationError
    from ._launch.local import init as init
    from ._launch.local import local_cluster as local_cluster
    from ._launch.local import shutdown as shutdown
    from ._launch.slurm import slurm_cluster as slurm_cluster
    from ._launch.ssh import ssh_cluster as ssh_cluster
    from ._model.devices import Device as Device
    from ._model.devices import Mesh as Mesh
    from ._model.jaxside import host_count as host_count
    from ._model.jaxside import host_index as host_index
    from ._model.sharding import NamedSharding as NamedSharding
    from ._model.sharding import ShapeDtypeStruct as ShapeDtypeStruct
    from ._model.sharding import Sharding as Sharding
    from ._model.sharding import SingleDeviceSharding as SingleDeviceSharding
    from ._observe.trace import CallTimings as CallTimings
    from ._observe.trace import HostTimings as HostTimings
    from ._wire.keys import load_key as load_key

__version__ = "0.1.0"

__all__ = [
    "Array",
    "AuthenticationError",
    "CallTimings",
    "ColobusError",
    "Controller",
    "ControllerClosedError",
    "Device",
    "Future",
    "HostInfo",
    "HostLostError",
    "HostTimings",
    "Mesh",
    "NamedSharding",
    "NoControllerError",
    "PartitionSpec",
    "ProtocolError",
    "RemoteError",
    "SerializationError",
    "ShapeDtypeStruct",
    "Sharding",
    "SingleDeviceSharding",
    "aclose",
    "block_until_ready",
    "close",
    "colocated_cpu_devices",
    "colocated_python",
    "colocated_python_class",
    "device_get",
    "device_put",
    "devices",
    "gather",
    "host_count",
    "host_index",
    "init",
    "load_key",
    "local_cluster",
    "make_mesh",
    "shutdown",
    "slurm_cluster",
    "ssh_cluster",
]

# Where each public name lives (the TYPE_CHECKING imports above, for type checkers).
_WHERE = {
    "Array": "._api.array",
    "device_get": "._api.fetch",
    "colocated_cpu_devices": "._api.entry",
    "devices": "._api.entry",
    "make_mesh": "._api.entry",
    "colocated_python": "._api.func",
    "gather": "._api.gather",
    "colocated_python_class": "._api.obj",
    "close": "._api.obj",
    "aclose": "._api.obj",
    "device_put": "._api.put",
    "block_until_ready": "._api.ready",
    "Controller": "._controller.controller",
    "HostInfo": "._controller.controller",
    "Future": "._controller.future",
    "AuthenticationError": "._errors",
    "ColobusError": "._errors",
    "ControllerClosedError": "._errors",
    "HostLostError": "._errors",
    "NoControllerError": "._errors",
    "ProtocolError": "._errors",
    "RemoteError": "._errors",
    "SerializationError": "._errors",
    "init": "._launch.local",
    "local_cluster": "._launch.local",
    "shutdown": "._launch.local",
    "slurm_cluster": "._launch.slurm",
    "ssh_cluster": "._launch.ssh",
    "Device": "._model.devices",
    "Mesh": "._model.devices",
    "host_count": "._model.jaxside",
    "host_index": "._model.jaxside",
    "NamedSharding": "._model.sharding",
    "ShapeDtypeStruct": "._model.sharding",
    "Sharding": "._model.sharding",
    "SingleDeviceSharding": "._model.sharding",
    "CallTimings": "._observe.trace",
    "HostTimings": "._observe.trace",
    "load_key": "._wire.keys",
    "PartitionSpec": "jax.sharding",
}


def __getattr__(name: str) -> _typing.Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _importlib.import_module(where, __name__)
    value = getattr(module, name)
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
