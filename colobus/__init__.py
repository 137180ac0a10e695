"""colobus: run Python colocated with the devices of many hosts, from one controller.

The API follows ``jax.experimental.colocated_python``; every remote operation
returns a :class:`Future` that can be awaited from any event loop.
"""

from ._api.array import Array as Array
from ._api.array import device_get as device_get
from ._api.entry import colocated_cpu_devices as colocated_cpu_devices
from ._api.entry import devices as devices
from ._api.entry import make_mesh as make_mesh
from ._api.func import colocated_python as colocated_python
from ._api.gather import gather as gather
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
from ._model.sharding import PartitionSpec as PartitionSpec
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
    "block_until_ready",
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
